"""locomesh wire protocol: versioned msgpack envelopes, length-prefixed frames, tensor payloads.

Nothing here imports hivemind at module level; the hivemind p2pd adapter lives in
``protocol.hivemind_transport`` and is imported only by the daemon.
"""

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
from protocol.tensors import tensor_from_wire, tensor_to_wire

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
