"""One-byte zeroth-order steps with shared seeds: the math of ``--algorithm zo``.

Every inner step a peer draws a seed s from (run id, round, step, peer id), regenerates a direction
z ~ N(0, I) from s block by block, measures its own batch's loss at θ + εz and θ − εz, and keeps
the central difference g = (L₊ − L₋)/(2ε) as ONE signed byte. Replicas exchange only these bytes
and every replica applies θ ← θ − lr·ĝ·z(s) for each (peer, step, byte) of a round, its own
included, in one agreed order, so the replicas stay bit-identical without sending weights.

References: Malladi et al. 2023, "Fine-Tuning Language Models with Just Forward Passes" (MeZO),
https://arxiv.org/abs/2305.17333; Zelikman et al. 2023, "Just One Byte (per gradient): A Note on
Low-Bandwidth Decentralized Language Model Finetuning Using Shared Randomness",
https://arxiv.org/abs/2306.10015; Qin et al. 2024,
"Federated Full-Parameter Tuning of Billion-Sized Language Models with Communication Cost under 18
Kilobytes" (FedKSeed), https://arxiv.org/abs/2312.06353.

Determinism (what makes the replicas identical):

- Seeds: :func:`step_seed` is a 63-bit BLAKE2b hash of (run id, round, step, peer id) or, with
  FedKSeed's fixed pool of K seeds (``--zo-seed-pool K``), the pool entry that hash picks, so the
  whole fine-tune is K accumulated scalars (:func:`pool_scalars`); block b of
  the direction of seed s comes from a CPU ``torch.Generator`` seeded with :func:`block_seed`
  (SplitMix64 of s and b). Blocks are cut in parameter order, ``BLOCK`` values each (a parameter's
  last block may be shorter), so any block can be regenerated alone and z is never held whole.
  ``torch.randn`` on CPU gives the same numbers in every process of one torch build on one CPU
  architecture (x86 with AVX2 vs ARM may differ: the fingerprints catch that and resync).
- Updates are two exactly rounded float32 operations per value (u = z·(lr·ĝ), θ ← θ − u), never a
  fused multiply-add, so vector width and thread count cannot change a bit.
- The order is :func:`agreed_order`: the de-duplicated set of (round, step, peer) sorted, never the
  order of arrival.
- Perturb-restore is exact: θ + εz is written in place; the few values whose round trip
  (θ + e) − e ≠ θ in float32 (a sum that crosses into a larger binade rounds more coarsely) go to a
  sparse undo log and are written back, so θ after the two evaluations is bit-identical to θ before
  (memory: 12 bytes for each logged value, 3.3 % of ``nano``'s pretrained parameters: ≈ 0.4 byte per
  parameter instead of a 4-byte copy of θ; a plain θ + εz − 2εz + εz leaves ~48 % of them off).

The one-byte code (``int8``, sign-magnitude): code 0 ↔ g = 0; otherwise ĝ = sign·exp((|p| + OFFSET)/16)
with |p| = clamp(round(16·ln|g|) − OFFSET, 1, 127) and OFFSET = ``CODE_OFFSET`` = −88, i.e.
|ĝ| ∈ [e^(−87/16), e^(39/16)] ≈ [0.0043, 11.4] in steps of e^(1/16) (6.4 %): a relative error of at
most e^(1/32) − 1 ≈ 3.2 % inside that range. Measured on ``nano`` after a short pretraining
(ε = 1e-3, batches of 8×64 bytes), |g| has a median of 0.6–0.75 and a 99th percentile near 3.5;
the finite-difference noise of float32 losses is ~1e-4. So |g| below 0.0043 rounds to 0 (no step)
and larger values saturate at ±11.4, a clip that also tames outliers. -128 is never sent.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from compression.seeds import MAX_SEED
from gossip.votes import Tenure, vote

BLOCK = 1 << 16  # values per z block
CODE_SCALE = 16  # codes are round(16·ln|g|)
CODE_OFFSET = -88  # |ĝ| = exp((|p| + CODE_OFFSET)/16), |p| in 1..127
CODE_MAX = 127
_MASK64 = (1 << 64) - 1


# ---- seeds --------------------------------------------------------------------------------------
def step_seed(run_id: str, round_no: int, step: int, peer_id: str, pool: int = 0) -> int:
    """The 63-bit seed of ``peer_id``'s direction at ``step`` of ``round_no`` in ``run_id``; with a seed
    pool of K > 0 (FedKSeed), the seed of the pool entry that hash picks (:func:`pool_index`)."""
    if pool:
        return pool_seed(run_id, pool_index(run_id, round_no, step, peer_id, pool))
    return _digest64(f"locomesh/zo|{run_id}|{round_no}|{step}|{peer_id}") & MAX_SEED


def pool_index(run_id: str, round_no: int, step: int, peer_id: str, pool: int) -> int:
    """Which of the run's ``pool`` seeds the step uses: uniform over 0..K−1, a hash of (run, round, step, peer)."""
    return _digest64(f"locomesh/zo-pick|{run_id}|{round_no}|{step}|{peer_id}") % pool


def pool_seed(run_id: str, index: int) -> int:
    """The seed of entry ``index`` of the run's fixed seed pool."""
    return _digest64(f"locomesh/zo-pool|{run_id}|{index}") & MAX_SEED


def _digest64(text: str) -> int:
    """64 bits of BLAKE2b over ``text``."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_seed(seed: int, block: int) -> int:
    """The generator seed of block ``block`` of the direction of ``seed`` (63 bits)."""
    return _splitmix64(_splitmix64(seed) ^ block) & MAX_SEED


def z_blocks(shapes: Sequence[torch.Size | tuple[int, ...]], seed: int, block: int = BLOCK
             ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(parameter index, flat start, z block) of the direction of ``seed``, in parameter order.

    Blocks never span two parameters; each is drawn fresh from its own generator (float32, CPU)."""
    gen = torch.Generator(device="cpu")
    index = 0
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        for start in range(0, numel, block):
            gen.manual_seed(block_seed(seed, index))
            yield i, start, torch.randn(min(block, numel - start), generator=gen, dtype=torch.float32)
            index += 1


def direction(shapes: Sequence[tuple[int, ...]], seed: int, block: int = BLOCK) -> list[torch.Tensor]:
    """The whole z of ``seed`` (tests only: nodes never hold it whole)."""
    out = [torch.empty(math.prod(s), dtype=torch.float32) for s in shapes]
    for i, start, z in z_blocks(shapes, seed, block):
        out[i][start:start + z.numel()] = z
    return [t.reshape(s) for t, s in zip(out, shapes)]


def _flat(p: torch.Tensor) -> torch.Tensor:
    if not p.is_contiguous():
        raise ValueError("zeroth-order steps need contiguous parameters")
    return p.data.view(-1)


# ---- exact in-place perturbation ----------------------------------------------------------------
@dataclass
class UndoLog:
    """Values a perturbation cannot give back by subtraction: {(parameter, block start): (offsets
    inside the block, original values)}."""

    entries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(int(idx.numel()) for idx, _ in self.entries.values())


def _shift(params: Sequence[torch.Tensor], seed: int, eps: float, sign: float, undo: UndoLog | None,
           block: int) -> UndoLog:
    """Write θ + sign·εz in place, block by block; returns the undo log of the new perturbation.

    With ``undo`` (θ currently holds θ − sign·εz, the opposite perturbation) the block is first taken
    back to θ exactly, so one pass moves θ + εz to θ − εz."""
    out = UndoLog()
    for i, start, z in z_blocks([p.shape for p in params], seed, block):
        x = _flat(params[i])[start:start + z.numel()]
        e = z.to(x.device).mul_(eps)  # εz, exactly rounded float32
        base = x
        if undo is not None:
            base = x.add(e) if sign > 0 else x.sub(e)
            if (i, start) in undo.entries:
                idx, vals = undo.entries[(i, start)]
                base[idx] = vals
        moved = base.add(e) if sign > 0 else base.sub(e)
        back = moved.sub(e) if sign > 0 else moved.add(e)
        bad = back.ne(base).nonzero().view(-1)
        if bad.numel():
            out.entries[(i, start)] = (bad, base[bad].clone())
        x.copy_(moved)
    return out


def _restore(params: Sequence[torch.Tensor], seed: int, eps: float, sign: float, undo: UndoLog, block: int) -> None:
    """θ currently holds θ + sign·εz: subtract it and write the undo log back, giving θ exactly."""
    for i, start, z in z_blocks([p.shape for p in params], seed, block):
        x = _flat(params[i])[start:start + z.numel()]
        e = z.to(x.device).mul_(eps)
        if sign > 0:
            x.sub_(e)
        else:
            x.add_(e)
        if (i, start) in undo.entries:
            idx, vals = undo.entries[(i, start)]
            x[idx] = vals


@torch.no_grad()
def spsa_estimate(loss: Callable[[], float], params: Sequence[torch.Tensor], seed: int, eps: float,
                  block: int = BLOCK) -> tuple[float, float, float]:
    """(g, L₊, L₋) with g = (L(θ+εz) − L(θ−εz))/(2ε); θ is left bit-identical.

    ``loss()`` evaluates the model (whose parameters are ``params``) on the step's batch. z is
    regenerated three times (θ→θ+εz, θ+εz→θ−εz, θ−εz→θ); nothing the size of θ is allocated."""
    undo = _shift(params, seed, eps, +1.0, None, block)
    try:
        plus = float(loss())
    except BaseException:
        _restore(params, seed, eps, +1.0, undo, block)
        raise
    undo = _shift(params, seed, eps, -1.0, undo, block)
    try:
        minus = float(loss())
    finally:
        _restore(params, seed, eps, -1.0, undo, block)
    return (plus - minus) / (2 * eps), plus, minus


# ---- the one-byte code --------------------------------------------------------------------------
def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# magnitudes rounded to float32 once: every process decodes a code to the same number
_MAGNITUDE = [0.0] + [_f32(math.exp((k + CODE_OFFSET) / CODE_SCALE)) for k in range(1, CODE_MAX + 1)]


def encode_grad(g: float) -> int:
    """g → one signed byte (-127..127); 0 for g = 0, a non-finite g, or |g| below the smallest level."""
    if not math.isfinite(g) or g == 0.0:
        return 0
    k = round(CODE_SCALE * math.log(abs(g))) - CODE_OFFSET
    if k < 1:
        return 0
    k = min(k, CODE_MAX)
    return k if g > 0 else -k


def decode_grad(code: int) -> float:
    """One signed byte → ĝ (a float32 value)."""
    if not -CODE_MAX <= code <= CODE_MAX:
        raise ValueError(f"zo code {code} is outside -{CODE_MAX}..{CODE_MAX}")
    return math.copysign(_MAGNITUDE[abs(code)], code) if code else 0.0


def pack_codes(codes: Sequence[int]) -> bytes:
    """Codes as raw ``int8`` bytes (one per step)."""
    return struct.pack(f"{len(codes)}b", *codes)


def unpack_codes(blob: bytes) -> list[int]:
    """Raw ``int8`` bytes → codes; -128 is refused."""
    codes = list(struct.unpack(f"{len(blob)}b", blob))
    if any(c < -CODE_MAX for c in codes):
        raise ValueError("zo code -128 is not a valid code")
    return codes


# ---- applying a round's codes -------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class StepCode:
    """One step's message: who took it, when, and its byte."""

    round: int
    step: int
    peer: str
    code: int


def expand(round_no: int, peer: str, codes: bytes | Sequence[int]) -> list[StepCode]:
    """A member's round of codes (step t = position t) as step messages."""
    values = unpack_codes(codes) if isinstance(codes, (bytes, bytearray, memoryview)) else list(codes)
    return [StepCode(round_no, t, peer, c) for t, c in enumerate(values)]


def agreed_order(messages: Iterable[StepCode]) -> list[StepCode]:
    """The de-duplicated messages sorted by (round, step, peer): the same list whatever the arrival
    order or repetitions. Two different codes for one (round, step, peer) raise ``ValueError``."""
    seen: dict[tuple[int, int, str], int] = {}
    for m in messages:
        key = (m.round, m.step, m.peer)
        if seen.setdefault(key, m.code) != m.code:
            raise ValueError(f"peer {m.peer} sent two codes for round {m.round} step {m.step}")
    return [StepCode(r, s, p, c) for (r, s, p), c in sorted(seen.items())]


@torch.no_grad()
def apply_codes(params: Sequence[torch.Tensor], messages: Iterable[StepCode], run_id: str, lr: float,
                block: int = BLOCK, pool: int = 0) -> int:
    """θ ← θ − lr·ĝ·z(s) for every message in :func:`agreed_order` (code 0 is skipped); returns how
    many moved θ. Each update is u = z·(lr·ĝ) then θ − u, both exactly rounded in float32."""
    ordered = [m for m in agreed_order(messages) if m.code != 0]
    shapes = [p.shape for p in params]
    for m in ordered:
        scale = lr * decode_grad(m.code)
        for i, start, z in z_blocks(shapes, step_seed(run_id, m.round, m.step, m.peer, pool), block):
            x = _flat(params[i])[start:start + z.numel()]
            x.sub_(z.to(x.device).mul_(scale))
    return len(ordered)


def pool_scalars(messages: Iterable[StepCode], run_id: str, lr: float, pool: int) -> list[float]:
    """FedKSeed's accumulated scalars: a_k = Σ lr·ĝ over the messages whose step drew pool seed k, so
    θ = θ₀ − Σ_k a_k·z(k) up to float32 rounding: a fine-tune of any size as K numbers."""
    scalars = [0.0] * pool
    for m in agreed_order(messages):
        if m.code:
            scalars[pool_index(run_id, m.round, m.step, m.peer, pool)] += lr * decode_grad(m.code)
    return scalars


@torch.no_grad()
def apply_pool_scalars(params: Sequence[torch.Tensor], scalars: Sequence[float], run_id: str, block: int = BLOCK) -> None:
    """θ ← θ − Σ_k a_k·z(pool seed k): rebuild a pool fine-tune from θ₀ and its K scalars."""
    shapes = [p.shape for p in params]
    for k, a in enumerate(scalars):
        if a:
            for i, start, z in z_blocks(shapes, pool_seed(run_id, k), block):
                x = _flat(params[i])[start:start + z.numel()]
                x.sub_(z.to(x.device).mul_(a))


def majority(fingerprints: dict[str, str], round_no: int, me: str, tenure: Tenure | None = None) -> tuple[str, str]:
    """(fingerprint, a peer holding it) of the most common fingerprint among ``{peer: fingerprint}``,
    counting ``me`` and established peers only (see :func:`gossip.votes.vote`: ties are not decided by peer id)."""
    return vote(fingerprints, round_no, me, tenure)
