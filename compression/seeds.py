"""Where shared-seed codecs get their seeds: one per (run, round, peer, part), blocks mixed in after.

A shared-seed payload carries one 63-bit seed; every block j of it draws from the generator
``hadamard.generator(seed, j)``. The seed itself is :func:`payload_seed` of the run id, the round, the
sending peer and the part's index, so a payload's random numbers are a pure function of
(run, round, peer, part, block): any peer regenerates them bit-identically, a replayed or reordered
payload cannot collide with another sender's, and nothing about them depends on the process.

The caller names the seed per encode (``codec.encode(t, seed=payload_seed(...))``); the codec reads
it with :func:`requested_seed` while it encodes. A thread-local slot, not a parameter, carries it so
codecs without randomness keep their plain ``_encode(x)``. Without a requested seed, a codec falls
back to its own choice (a hash of the tensor for rotations, the OS for the projection).
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from typing import Iterator

MAX_SEED = (1 << 63) - 1
_slot = threading.local()


def payload_seed(run_id: str, round_no: int, peer: str, part: int) -> int:
    """63 bits of BLAKE2b over (run, round, peer, part): the seed of one payload."""
    if round_no < 0 or part < 0:
        raise ValueError(f"round and part must be ≥ 0, got round {round_no}, part {part}")
    key = f"{run_id}\x00{round_no}\x00{peer}\x00{part}".encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"locomesh-seed").digest(), "big") & MAX_SEED


@contextmanager
def seed_for_encode(seed: int | None) -> Iterator[None]:
    """Make ``seed`` the requested seed of encodes on this thread while the block runs."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    previous = getattr(_slot, "seed", None)
    _slot.seed = seed
    try:
        yield
    finally:
        _slot.seed = previous


def requested_seed() -> int | None:
    """The seed the current encode on this thread was asked to use, or None."""
    return getattr(_slot, "seed", None)
