"""Shared-seed codecs: the seed projection is unbiased and reproducible; the subspace codec is exact
on its span."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compression import CodecError, Payload, get_codec
from compression.activations import SubspaceProjection, subspace_basis
from compression.seeded import ROWS_PER_BLOCK, SeedProjection, projection_blocks, projection_matrix

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dist", ["rademacher", "gaussian"])
def test_seed_projection_is_unbiased(dist: str) -> None:
    """Average N independent decodes of x. One decode has per-coordinate variance
    (‖x‖² − x_i²)/R (Rademacher) or (‖x‖² + x_i²)/R (Gaussian), so the mean of N has standard error
    σ_i = √((‖x‖² + x_i²)/(R·N)); every coordinate must land within 5σ_i (two-sided normal tail
    5.7e-7 per coordinate, ~2e-5 for all 32; the seeds are fixed, so the test is deterministic)."""
    seeds = random.Random(7)
    codec = SeedProjection(4, dist, seed_source=lambda: seeds.getrandbits(63))
    x = torch.randn(32, generator=torch.Generator().manual_seed(3))
    n = 3000
    total = torch.zeros(32, dtype=torch.float64)
    for _ in range(n):
        total += codec.decode(codec.encode(x)).double()
    mean = total / n
    sigma = ((x.double().norm() ** 2 + x.double() ** 2) / (4 * n)).sqrt()
    assert bool(((mean - x.double()).abs() <= 5 * sigma).all())
    # and the estimate really is noisy per round (it is a projection, not a copy)
    assert float((codec.decode(codec.encode(x)) - x).norm()) > 0.1 * float(x.norm())


def test_seed_projection_streams_blocks_without_materialising_z() -> None:
    d = 2 * ROWS_PER_BLOCK + 5
    blocks = list(projection_blocks(11, d, 3))
    assert [start for start, _ in blocks] == [0, ROWS_PER_BLOCK, 2 * ROWS_PER_BLOCK]
    assert max(b.shape[0] for _, b in blocks) == ROWS_PER_BLOCK
    z = projection_matrix(11, d, 3)
    assert set(z.unique().tolist()) == {-1.0, 1.0}
    x = torch.randn(d)
    codec = SeedProjection(3, seed_source=lambda: 11)
    payload = codec.encode(x)
    assert payload.fields["seed"] == 11
    assert torch.allclose(codec.decode(payload), z @ ((z.T.double() @ x.double()) / 3).float(), atol=1e-3)
    assert payload.nbytes < 120  # a seed and three floats


_CHILD = r"""
import hashlib, json, sys
import torch
from compression import Payload, get_codec
from compression.seeded import projection_matrix
from compression.activations import subspace_basis
out = {}
for dist in ("rademacher", "gaussian"):
    out[dist] = hashlib.sha256(projection_matrix(123456789, 40000, 5, dist).numpy().tobytes()).hexdigest()
payload = Payload.from_bytes(bytes.fromhex(sys.stdin.read()))
out["decoded"] = hashlib.sha256(get_codec(payload.codec).decode(payload).numpy().tobytes()).hexdigest()
out["basis"] = hashlib.sha256(subspace_basis(64, 8, 5).numpy().tobytes()).hexdigest()
print(json.dumps(out))
"""


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_same_seed_regenerates_bit_identical_z_in_another_process() -> None:
    codec = SeedProjection(6, "gaussian", seed_source=lambda: 987654321)
    payload = codec.encode(torch.randn(3, 70000))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=payload.to_bytes().hex(),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    theirs = json.loads(child.stdout)
    for dist in ("rademacher", "gaussian"):
        assert theirs[dist] == _sha(projection_matrix(123456789, 40000, 5, dist))
    assert theirs["decoded"] == _sha(codec.decode(payload))
    assert theirs["basis"] == _sha(subspace_basis(64, 8, 5))


def test_seed_payload_validation() -> None:
    codec = get_codec("seed:r=2")
    payload = codec.encode(torch.randn(10))
    for seed in (-1, 1 << 63, "1", 1.5):
        with pytest.raises(CodecError):
            codec.decode(Payload(payload.codec, payload.version, payload.shape, {**payload.fields, "seed": seed}))


def test_subspace_is_exact_on_its_span() -> None:
    codec = get_codec("subspace:k=32,d=128")
    assert isinstance(codec, SubspaceProjection)
    u = codec.basis
    assert u.shape == (128, 32)
    assert torch.allclose(u.T @ u, torch.eye(32), atol=1e-6)
    coef = torch.randn(4, 10, 32).bfloat16().float()  # representable in the bf16 wire format
    x = coef @ u.T  # (batch, tokens, d) activations inside span(U)
    payload = codec.encode(x)
    assert torch.equal(payload_coef(payload), coef)
    out = codec.decode(Payload.from_bytes(payload.to_bytes()))
    assert torch.allclose(out, x, atol=1e-6, rtol=0)
    assert payload.fields["coef"]["shape"] == [4, 10, 32]
    assert payload.nbytes < 4 * 10 * 32 * 2 + 120  # 2k bytes per token plus the header


def payload_coef(payload: Payload) -> torch.Tensor:
    data = bytes(payload.fields["coef"]["data"])
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).float().reshape(payload.fields["coef"]["shape"])


def test_subspace_drops_the_orthogonal_part_and_fixes_d() -> None:
    codec = get_codec("subspace:k=4,d=16,seed=3,dtype=fp16")
    u = codec.basis
    inside = torch.randn(5, 4).half().float() @ u.T
    outside = torch.randn(5, 16)
    outside -= (outside @ u) @ u.T
    out = codec.decode(codec.encode(inside + outside))
    assert torch.allclose(out, inside, atol=1e-3)
    with pytest.raises(ValueError, match="last dimension is 16"):
        codec.encode(torch.randn(5, 15))
    with pytest.raises(ValueError):
        codec.encode(torch.tensor(1.0))
    with pytest.raises(ValueError, match="d=D"):
        get_codec("subspace:k=32")
    other = get_codec("subspace:k=4,d=16")  # another seed: another basis, another spec
    assert other.spec != codec.spec and not torch.equal(other.basis, u)
    with pytest.raises(CodecError):
        other.decode(codec.encode(inside))
    bad = Payload(codec.spec, codec.version, (5, 17), codec.encode(inside).fields)
    with pytest.raises(CodecError, match="d=16"):
        codec.decode(bad)
