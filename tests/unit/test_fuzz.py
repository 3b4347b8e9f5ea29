"""A seeded fuzz pass over every decoder and handler (the long run: `python -m tests.helpers.fuzz --iterations 100000`)."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import ProtocolError
from tests.helpers.fuzz import build_targets, fuzz

TARGETS = {t.name: t for t in build_targets()}


def test_seeded_mutation_fuzz_finds_no_crash_or_hang():
    report = fuzz(iterations=400, seed=1234)
    assert report["inputs"] == 400 * len(TARGETS)
    assert not report["crashes"], report["crashes"][:3]
    assert not report["hangs"], report["hangs"][:3]
    for name, stats in report["targets"].items():
        assert stats["accepted"] >= 1, f"{name}: even the valid seed input was refused, so the target tests nothing"
        assert stats["refused"] >= 1, f"{name}: no mutated input was refused"


@given(target=st.sampled_from(sorted(TARGETS)), data=st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_are_accepted_or_refused_with_a_typed_error(target, data):
    try:
        asyncio.run(asyncio.wait_for(TARGETS[target].run(data), 5))
    except (ProtocolError, EOFError):
        pass
