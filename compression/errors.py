"""Codec errors: a payload refused by a receiver, with what was wrong and why."""

from __future__ import annotations

from protocol.errors import SchemaError


class CodecError(SchemaError):
    """A compressed payload failed validation: wrong codec or version, bad lengths, values out of range.

    It subclasses :class:`protocol.errors.SchemaError`, so transport code that already turns schema
    errors into refusals (metrics label ``schema``) handles it without knowing about codecs.
    """

    code = "codec"
