"""Checks and tools the compression tests share (``tests/unit/test_compression*.py``): a codec's wire
round trip, decoding corrupted bytes, encoding that leaves its input alone, forged payloads, and
comparing tensors with another process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from compression import CodecError, Payload

ROOT = Path(__file__).resolve().parents[2]


def wire_roundtrip(codec: Any, x: torch.Tensor) -> tuple[Payload, bytes, torch.Tensor]:
    """Encode ``x``, check the payload's size and that its bytes parse back to an equal payload, and
    decode the parsed one: (payload, its bytes, decoded tensor)."""
    payload = codec.encode(x)
    data = payload.to_bytes()
    assert payload.nbytes == len(data)
    parsed = Payload.from_bytes(data)
    assert parsed == payload
    return payload, data, codec.decode(parsed)


def decode_corrupted(codec: Any, x: torch.Tensor, position: int, value: int, cut: bool) -> torch.Tensor | None:
    """Encode ``x``, then cut the bytes at ``position`` (modulo their length) or set that byte to
    ``value``, and decode them: the tensor, or None where the codec refused them with a ``CodecError``."""
    data = bytearray(codec.encode(x).to_bytes())
    position %= len(data)
    if cut:
        del data[position:]
    else:
        data[position] = value
    try:
        return codec.decode(Payload.from_bytes(bytes(data)))
    except CodecError:
        return None


def assert_encode_leaves_input_alone(codec: Any, x: torch.Tensor) -> None:
    """Encoding does not modify ``x``, and the payload's bytes do not alias it."""
    before = x.clone()
    payload = codec.encode(x)
    data = payload.to_bytes()
    assert torch.equal(x, before)
    x.add_(1.0)
    assert Payload.from_bytes(data) == payload


def with_fields(payload: Payload, **fields: object) -> Payload:
    """``payload`` with these fields replaced."""
    return Payload(payload.codec, payload.version, payload.shape, {**payload.fields, **fields})


def without_field(payload: Payload, name: str) -> Payload:
    """``payload`` without field ``name``."""
    return Payload(payload.codec, payload.version, payload.shape, {k: v for k, v in payload.fields.items() if k != name})


def tensor_field(payload: Payload, name: str, **changes: object) -> dict:
    """Tensor field ``name`` of ``payload`` (its dtype, shape and data) with these entries changed."""
    return {**payload.fields[name], **changes}


def sha(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (to compare it with another process's)."""
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def run_child(code: str, stdin: str) -> Any:
    """Run Python ``code`` in a fresh process of this checkout (two threads) with ``stdin``; its stdout, parsed as JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    child = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return json.loads(child.stdout)
