"""locomesh wire protocol: versioned msgpack envelopes, length-prefixed frames, tensor payloads.

Nothing here imports hivemind or torch at module level: the hivemind p2pd adapter lives in
``protocol.hivemind_transport`` (imported by the daemon), the py-libp2p one in
``protocol.libp2p_transport`` (the light client), and the torch tensor helpers are loaded on first use,
so a light client can import the framing without torch.
"""

from typing import Any

from protocol.errors import (
    AuthError,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    RemoteError,
    SchemaError,
    StreamTimeout,
    VersionMismatch,
)
from protocol.frames import (
    DEFAULT_MAX_FRAME,
    FramedStream,
    Message,
    decode_message,
    encode_frame,
    encode_message,
    read_frame,
)
from protocol.ids import PROTOCOL_MAJOR, PROTOCOL_MINOR, protocol_id

_LAZY = {"tensor_from_wire": "protocol.tensors", "tensor_to_wire": "protocol.tensors"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'protocol' has no attribute {name!r}")


__all__ = [
    "AuthError",
    "DEFAULT_MAX_FRAME",
    "FrameTooLarge",
    "FramedStream",
    "MalformedFrame",
    "Message",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "ProtocolError",
    "RemoteError",
    "SchemaError",
    "StreamTimeout",
    "VersionMismatch",
    "decode_message",
    "encode_frame",
    "encode_message",
    "protocol_id",
    "read_frame",
    "tensor_from_wire",
    "tensor_to_wire",
]
