"""Codec specs: parse a spec string into a codec; ``codec.spec`` is the canonical form of it.

Valid forms (K, C, R, k, d, B, S are positive integers):

  none | fp16 | bf16                 dense float32 / 16-bit casts
  q8 | q4 | q2                       statistical quantizer, 256 / 16 / 4 bins
  rot1 | rot2 | rot4 | rot8          randomized Hadamard rotation + Gaussian Lloyd–Max levels (DRIVE/EDEN)
  int8-block[:B]                     blockwise absmax int8, blocks of B (default 4096)
  topk:K/C[+qB|+rotB]                chunked top-k, K kept per chunk of C (2-D: √C×√C tiles);
                                     values as float32, statistically quantized (B = 8, 4, 2) or
                                     rotated and quantized (B = 1, 2, 4, 8)
  dct:K/C[+q8|+q4|+q2]               chunked DCT-II, top-K coefficients per chunk (DeMo)
  seed:r=R[,dist=rademacher|gaussian]   shared-seed projection, block by block: R directions per block
                                     of 4096 values on average (the tensor's budget of R·⌈numel/4096⌉
                                     directions is shared out by block norm); 1 ≤ R ≤ 64 (16 for
                                     gaussian), because encoding costs numel·R random numbers
  subspace:k=K,d=D[,seed=S][,dtype=bf16|fp16]   fixed orthonormal projection of the last dim
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from compression.activations import SubspaceProjection
from compression.base import Codec
from compression.blockwise import BlockwiseInt8
from compression.dct import DCTCompression
from compression.dense import CastCompression, NoCompression
from compression.quantize import StatisticalQuantization
from compression.rotation import RotationQuantization
from compression.seeded import SeedProjection
from compression.topk import TopKCompression

SPEC_FORMS = (
    "none",
    "fp16",
    "bf16",
    "q8",
    "q4",
    "q2",
    "rot1",
    "rot2",
    "rot4",
    "rot8",
    "int8-block[:B]",
    "topk:K/C[+q8|+q4|+q2|+rot1|+rot2|+rot4|+rot8]",
    "dct:K/C[+q8|+q4|+q2]",
    "seed:r=R[,dist=rademacher|gaussian]",
    "subspace:k=K,d=D[,seed=S][,dtype=bf16|fp16]",
)

_INT = r"[1-9][0-9]{0,9}"


def _invalid(spec: str, why: str) -> ValueError:
    return ValueError(f"invalid codec spec {spec!r:.80}: {why}. Valid forms: {', '.join(SPEC_FORMS)}")


def _dense(spec: str) -> Codec | None:
    simple: dict[str, Callable[[], Codec]] = {
        "none": NoCompression,
        "fp16": lambda: CastCompression(torch.float16),
        "bf16": lambda: CastCompression(torch.bfloat16),
    }
    factory = simple.get(spec)
    return factory() if factory else None


def _quantized(spec: str) -> Codec | None:
    match = re.fullmatch(r"q([248])", spec)
    return StatisticalQuantization(int(match.group(1))) if match else None


def _rotation(spec: str) -> Codec | None:
    if not spec.startswith("rot"):
        return None
    match = re.fullmatch(r"rot([1248])", spec)
    if not match:
        raise _invalid(spec, "rotation quantization takes 1, 2, 4 or 8 bits, as in rot2")
    return RotationQuantization(int(match.group(1)))


def _blockwise(spec: str) -> Codec | None:
    if not spec.startswith("int8-block"):
        return None
    if spec == "int8-block":
        return BlockwiseInt8()
    match = re.fullmatch(rf"int8-block:({_INT})", spec)
    if not match:
        raise _invalid(spec, "int8-block takes an optional block size, as in int8-block:4096")
    return _build(spec, lambda: BlockwiseInt8(int(match.group(1))))


def _build(spec: str, factory: Callable[[], Codec]) -> Codec:
    """Run a codec constructor, turning its parameter complaints into spec errors."""
    try:
        return factory()
    except ValueError as e:
        raise _invalid(spec, str(e)) from None


def _chunked(spec: str) -> Codec | None:
    family = spec.split(":", 1)[0]
    if family not in ("topk", "dct"):
        return None
    quantizers = "q[248]|rot[1248]" if family == "topk" else "q[248]"  # DCT coefficients: +qB only
    match = re.fullmatch(rf"(topk|dct):({_INT})/({_INT})(?:\+({quantizers}))?", spec)
    if not match:
        options = "+q8/+q4/+q2 or +rot1/+rot2/+rot4/+rot8" if family == "topk" else "+q8/+q4/+q2"
        raise _invalid(spec, f"{family} needs K/C and an optional {options}, as in {family}:64/4096+q2")
    k, chunk, values = int(match.group(2)), int(match.group(3)), match.group(4) or ""
    bits = int(values[-1]) if values else None
    if family == "dct":
        return _build(spec, lambda: DCTCompression(k, chunk, bits))
    return _build(spec, lambda: TopKCompression(k, chunk, bits, rotated=values.startswith("rot")))


def _options(spec: str, body: str, allowed: dict[str, str]) -> dict[str, str]:
    """Parse ``key=value,key=value`` with each key at most once and each value matching its pattern."""
    out: dict[str, str] = {}
    for item in body.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in allowed or key in out or not re.fullmatch(allowed[key], value):
            raise _invalid(spec, f"bad option {item!r:.40}; options are {', '.join(f'{k}=' for k in allowed)}")
        out[key] = value
    return out


def _seeded(spec: str) -> Codec | None:
    if not spec.startswith("seed"):
        return None
    if not spec.startswith("seed:"):
        raise _invalid(spec, "the seed codec needs its number of directions, as in seed:r=16")
    opts = _options(spec, spec[5:], {"r": _INT, "dist": "rademacher|gaussian"})
    if "r" not in opts:
        raise _invalid(spec, "the seed codec needs r=R")
    return _build(spec, lambda: SeedProjection(int(opts["r"]), opts.get("dist", "rademacher")))


def _subspace(spec: str) -> Codec | None:
    if not spec.startswith("subspace"):
        return None
    if not spec.startswith("subspace:"):
        raise _invalid(spec, "subspace needs k and d, as in subspace:k=32,d=128")
    opts = _options(spec, spec[9:], {"k": _INT, "d": _INT, "seed": r"0|[1-9][0-9]{0,18}", "dtype": "bf16|fp16"})
    if "k" not in opts or "d" not in opts:
        raise _invalid(spec, "subspace needs both k=K and d=D (the last-dimension size is fixed by the spec)")
    k, d, seed = int(opts["k"]), int(opts["d"]), int(opts.get("seed", "0"))
    return _build(spec, lambda: SubspaceProjection(k, d, seed, opts.get("dtype", "bf16")))


_PARSERS: tuple[Callable[[str], Codec | None], ...] = (
    _dense, _quantized, _rotation, _blockwise, _chunked, _seeded, _subspace
)


def get_codec(spec: str) -> Codec:
    """The codec for ``spec``; raises ``ValueError`` listing the valid forms when it is unknown or malformed."""
    if not isinstance(spec, str):
        raise _invalid(repr(spec), "a spec must be a string")
    for parser in _PARSERS:
        codec = parser(spec)
        if codec is not None:
            return codec
    raise _invalid(spec, "unknown codec")
