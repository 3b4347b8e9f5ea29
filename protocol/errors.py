"""Typed protocol errors: each says what was wrong with the bytes a peer sent and why it was refused."""

import unicodedata


def printable(text: object, limit: int = 300) -> str:
    """Peer-supplied text made safe for a log line or a terminal: control characters (escape sequences,
    newlines that would forge log lines) shown as ``\\uXXXX``, cut to ``limit`` characters."""
    s = str(text)
    cut = len(s) - limit
    s = "".join(c if c == " " or unicodedata.category(c)[0] not in "CZ" else f"\\u{ord(c):04x}" for c in s[:limit])
    return s + (f"… ({cut} more characters)" if cut > 0 else "")


class ProtocolError(Exception):
    """Base of every wire-level rejection. ``code`` is a stable label used in metrics and error frames."""

    code = "protocol"


class FrameTooLarge(ProtocolError):
    """A frame announced more bytes than the receiver accepts (checked before allocating)."""

    code = "frame_too_large"


class MalformedFrame(ProtocolError):
    """Bytes that are not a valid msgpack envelope, or a stream that ended mid-frame."""

    code = "malformed"


class TruncatedFrame(MalformedFrame):
    """The stream ended inside a frame: a broken connection more often than a broken peer."""


class VersionMismatch(ProtocolError):
    """The envelope's major protocol version differs from ours."""

    code = "version"


class IncompatiblePeer(VersionMismatch):
    """The peer runs another protocol version (``protocol.version``): the message is the one line that
    names both versions and what to do, already logged once for that peer."""


class SchemaError(ProtocolError):
    """A well-formed message whose fields have the wrong kind, type, shape or value."""

    code = "schema"


class GroupClosed(SchemaError):
    """A round's contribution asked for by a peer outside the group this node's rendezvous closed with: the
    peer registered after the close, so it is late for the round (it follows the round's result instead)."""

    code = "group_closed"


class RemoteError(ProtocolError):
    """The peer answered with an error frame; ``remote_code`` is its label."""

    code = "remote"

    def __init__(self, remote_code: str, message: str) -> None:
        remote_code, message = printable(remote_code, 40), printable(message)  # the peer chose both
        super().__init__(f"peer refused: [{remote_code}] {message}")
        self.remote_code = remote_code


class AuthError(ProtocolError):
    """The peer did not prove it holds this private swarm's key."""

    code = "auth"


class StreamTimeout(ProtocolError):
    """The peer stalled: no complete frame arrived within the stream's idle timeout."""

    code = "timeout"
