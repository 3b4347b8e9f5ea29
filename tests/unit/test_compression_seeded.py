"""Shared-seed codecs: the block-wise seed projection is contractive, shares its directions by block
norm, bounds its cost and is reproducible across processes; the subspace codec is exact on its span."""

from __future__ import annotations

import json
import random

import msgpack
import pytest
import torch

from compression import SPEC_FORMS, CodecError, ErrorFeedback, Payload, get_codec
from compression.activations import SubspaceProjection, subspace_basis
from compression.seeded import BLOCK, MAX_DIRECTIONS, SeedProjection, allocate, block_directions
from tests.helpers.codec_checks import run_child, sha


def _fixed(seed: int) -> random.Random:
    return random.Random(seed)


@pytest.mark.parametrize("dist", ["rademacher", "gaussian"])
def test_seed_projection_is_a_contraction(dist: str) -> None:
    """Every decode is the projection of each block onto one line: ‖x − x̂‖² = ‖x‖² − ‖x̂‖² < ‖x‖²,
    with ‖x − x̂‖² ≈ (1 − r/(b + r))·‖x‖² on average (δ ≈ r/(b + r) per round)."""
    seeds = _fixed(7)
    r = 16
    codec = SeedProjection(r, dist, seed_source=lambda: seeds.getrandbits(63))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3 * BLOCK, generator=g) * torch.tensor([1.0, 3.0, 0.5]).repeat_interleave(BLOCK)
    ratios = []
    for _ in range(24):
        out = codec.decode(codec.encode(x))
        for xb, ob in zip(x.double().split(BLOCK), out.double().split(BLOCK)):
            assert abs(float((xb - ob) @ ob)) <= 1e-4 * float(xb @ xb)  # residual ⟂ reconstruction
        err = float((out.double() - x.double()).square().sum())
        assert err < float(x.double().square().sum())
        ratios.append(err / float(x.double().square().sum()))
    mean = sum(ratios) / len(ratios)
    delta = r / (BLOCK + r)
    assert 1 - 2 * delta <= mean <= 1 - 0.5 * delta


@pytest.mark.parametrize("spec", ["seed:r=4", "seed:r=16,dist=gaussian", "seed:r=64"])
@pytest.mark.parametrize("shape", [(20000,), (130, 70), (5,)])
def test_error_feedback_residual_stays_bounded(spec: str, shape: tuple[int, ...]) -> None:
    """30 rounds of independent updates with β = 1: the residual stays within 10× one update's norm.
    (An unbiased Z·Zᵀx/R reconstruction multiplies it by about √(d/R) every round instead.)"""
    codec, ef = get_codec(spec), ErrorFeedback(decay=1.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        update = torch.randn(shape, generator=g)
        codec.encode(update, state=ef)
        assert ef.norm() <= 10 * float(update.norm())


def _fields(payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.frombuffer(bytearray(payload.fields["counts"]["data"]), dtype=torch.int16).long()
    coef = torch.frombuffer(bytearray(payload.fields["coef"]["data"]), dtype=torch.float32)
    return counts, coef


def test_directions_follow_block_norms_and_cost_is_linear() -> None:
    scales = torch.tensor([0.0, 1.0, 4.0, 2.0, 1.0])
    x = torch.randn(5 * BLOCK - 100, generator=torch.Generator().manual_seed(2))
    x *= scales.repeat_interleave(BLOCK)[: x.numel()]
    codec = SeedProjection(8, seed_source=lambda: 5)
    payload = codec.encode(x)
    counts, coef = _fields(payload)
    assert counts.tolist() == allocate(torch.tensor([float(b.norm()) for b in x.split(BLOCK)]),
                                       torch.tensor([BLOCK] * 4 + [BLOCK - 100]), 8 * 5).tolist()
    assert counts[0] == 0 and int(counts.sum()) == 8 * 5 and coef.numel() == 8 * 5
    assert counts[2] > counts[3] > counts[1]
    assert int(counts[2]) == pytest.approx(40 * 4 / 8, abs=2)
    out = codec.decode(payload)
    assert torch.equal(out[:BLOCK], torch.zeros(BLOCK))  # a zero block gets no direction and decodes to 0
    # cost: Σ_j counts_j·size_j random numbers, at most R·⌈d/b⌉·b
    sizes = torch.tensor([b.numel() for b in x.split(BLOCK)])
    assert int((counts * sizes).sum()) <= 8 * 5 * BLOCK
    assert payload.nbytes <= 4 * 40 + 2 * 5 + 110  # float32 coefficients, int16 counts, the header


def test_allocate_caps_blocks_and_redistributes() -> None:
    sizes = torch.tensor([4096, 4096, 4096, 10])
    assert allocate(torch.tensor([1.0, 4.0, 0.0, 2.0]), sizes, 64).tolist() == [11, 43, 0, 10]
    assert allocate(torch.tensor([1.0, 4.0, 0.0, 2.0]), sizes, 10**6).tolist() == [4096, 4096, 0, 10]
    assert allocate(torch.zeros(3), sizes[:3], 30).tolist() == [0, 0, 0]
    assert allocate(torch.ones(3), sizes[:3], 31).sum() == 31


def test_decode_matches_the_regenerated_blocks() -> None:
    x = torch.randn(BLOCK + 17, generator=torch.Generator().manual_seed(4))
    codec = SeedProjection(3, seed_source=lambda: 11)
    payload = codec.encode(x)
    assert payload.fields["seed"] == 11
    counts, coef = _fields(payload)
    expected, offset = [], 0
    for j, (block, count) in enumerate(zip(x.split(BLOCK), counts.tolist())):
        if not count:  # a block without directions decodes to zero
            expected.append(torch.zeros(block.numel(), dtype=torch.float64))
            continue
        z = block_directions(11, j, block.numel(), count).double()
        assert set(z.unique().tolist()) <= {-1.0, 1.0}
        c = z @ block.double()
        assert torch.allclose(coef[offset : offset + count].double(), c, rtol=1e-5, atol=1e-4)
        v = z.T @ c
        expected.append(v * (c @ c) / (v @ v))
        offset += count
    assert int(counts.sum()) == 6
    assert torch.allclose(codec.decode(payload).double(), torch.cat(expected), atol=1e-4)
    assert payload.nbytes < 140  # a seed, two counts and six floats


@pytest.mark.parametrize("spec", ["seed:r=65", "seed:r=1024", "seed:r=4097", "seed:r=17,dist=gaussian",
                                  "seed:r=0"])
def test_costly_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        get_codec(spec)
    assert all(form in str(info.value) for form in SPEC_FORMS)
    dist = "gaussian" if "gaussian" in spec else "rademacher"
    if spec != "seed:r=0":  # that one fails the number pattern first
        assert f"R ≤ {MAX_DIRECTIONS[dist]} {dist} directions per block" in str(info.value)
    assert get_codec(f"seed:r={MAX_DIRECTIONS[dist]}" + (",dist=gaussian" if dist == "gaussian" else ""))


_CHILD = r"""
import hashlib, json, sys
import torch
from compression import Payload, get_codec
from compression.seeded import block_directions
from compression.activations import subspace_basis
out = {}
for dist in ("rademacher", "gaussian"):
    out[dist] = hashlib.sha256(block_directions(123456789, 7, 4000, 70, dist).numpy().tobytes()).hexdigest()
payloads = [Payload.from_bytes(bytes.fromhex(h)) for h in json.loads(sys.stdin.read())]
out["decoded"] = [hashlib.sha256(get_codec(p.codec).decode(p).numpy().tobytes()).hexdigest() for p in payloads]
out["basis"] = hashlib.sha256(subspace_basis(64, 8, 5).numpy().tobytes()).hexdigest()
print(json.dumps(out))
"""


def test_same_seed_regenerates_bit_identical_directions_in_another_process() -> None:
    x = torch.randn(3, 70000, generator=torch.Generator().manual_seed(6))
    payloads = [SeedProjection(6, dist, seed_source=lambda: 987654321).encode(x) for dist in ("rademacher", "gaussian")]
    theirs = run_child(_CHILD, json.dumps([p.to_bytes().hex() for p in payloads]))
    for name in ("rademacher", "gaussian"):
        assert theirs[name] == sha(block_directions(123456789, 7, 4000, 70, name))
    assert theirs["decoded"] == [sha(get_codec(p.codec).decode(p)) for p in payloads]
    assert theirs["basis"] == sha(subspace_basis(64, 8, 5))


def _tampered(payload: Payload, edit) -> bytes:
    obj = msgpack.unpackb(payload.to_bytes(), raw=False)
    edit(obj["f"])
    return msgpack.packb(obj, use_bin_type=True)


def _set_counts(values: list[int]):
    def edit(fields: dict) -> None:
        data = torch.tensor(values, dtype=torch.int16).numpy().tobytes()
        fields["counts"] = {"dtype": "int16", "shape": [len(values)], "data": data}
    return edit


def test_seed_payload_validation() -> None:
    codec = get_codec("seed:r=2")
    payload = codec.encode(torch.randn(2 * BLOCK + 10, generator=torch.Generator().manual_seed(8)))  # budget 6
    for seed in (-1, 1 << 63, "1", 1.5, True):
        with pytest.raises(CodecError):
            codec.decode(Payload(payload.codec, payload.version, payload.shape, {**payload.fields, "seed": seed}))
    coef_len = payload.fields["coef"]["shape"][0]

    def set_coef(values: list[float]):
        def edit(fields: dict) -> None:
            data = torch.tensor(values).numpy().tobytes()
            fields["coef"] = {"dtype": "float32", "shape": [len(values)], "data": data}
        return edit

    bad_edits = [
        _set_counts([-1, 4, 3]),  # negative
        _set_counts([0, 0, 11]),  # the last block has only 10 values
        _set_counts([3, 3, 3]),  # 9 directions, over the budget of 2·3
        _set_counts([2, 2]),  # one count per block
        set_coef([1.0] * (coef_len + 1)),  # one coefficient per direction
        set_coef([float("nan")] * coef_len),
        set_coef([3e38] * coef_len),  # the reconstruction overflows float32
        lambda fields: fields.pop("counts"),
        lambda fields: fields["counts"].update(dtype="uint8", data=b"\x02" * 3),
    ]
    for edit in bad_edits:
        with pytest.raises(CodecError):
            codec.decode(Payload.from_bytes(_tampered(payload, edit)))
    grown = Payload(payload.codec, payload.version, (5 * BLOCK,), payload.fields)
    with pytest.raises(CodecError):
        codec.decode(Payload.from_bytes(grown.to_bytes()))


def test_empty_and_tiny_tensors() -> None:
    for shape in [(), (0,), (3, 0), (1,), (7,)]:
        x = torch.randn(shape)
        codec = get_codec("seed:r=64")
        out = codec.decode(Payload.from_bytes(codec.encode(x).to_bytes()))
        assert out.shape == x.shape and out.dtype == torch.float32
        if x.numel():
            assert float((out - x).norm()) <= float(x.norm()) * (1 + 1e-5)


def test_subspace_is_exact_on_its_span() -> None:
    codec = get_codec("subspace:k=32,d=128")
    assert isinstance(codec, SubspaceProjection)
    u = codec.basis
    assert u.shape == (128, 32)
    assert torch.allclose(u.T @ u, torch.eye(32), atol=1e-6)
    generator = torch.Generator().manual_seed(0)
    coef = torch.randn(4, 10, 32, generator=generator).bfloat16().float()  # representable in the bf16 wire format
    x = coef @ u.T  # (batch, tokens, d) activations inside span(U)
    payload = codec.encode(x)
    # the float32 projection x·U is exact up to ~1e-6·‖x‖: a tiny coefficient may round to its bf16
    # neighbour, never further (an unseeded draw made this test fail now and then)
    ulp = coef.abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool(((payload_coef(payload) - coef).abs() <= torch.maximum(ulp, torch.full_like(ulp, 1e-5))).all())
    out = codec.decode(Payload.from_bytes(payload.to_bytes()))
    assert torch.allclose(out, x, atol=1e-5, rtol=0)
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
