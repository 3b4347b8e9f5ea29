"""Top-k's sizes and limits by hand: Elias–Fano widths, packed index widths, the choice between them, the spec and its bounds.

Both sides derive every size from (K, C) alone, so a size off by one bit is a wire break between
versions; these pin the formulas of ``compression/elias_fano.py`` and ``compression/topk.py`` to numbers.
"""

from __future__ import annotations

import pytest

from compression import elias_fano
from compression.topk import TopKCompression, index_bits, uses_elias_fano


@pytest.mark.parametrize("k,chunk,low,high", [
    (64, 4096, 6, 64 + 64),  # 4096/64 = 64 = 2^6: six low bits, 64 ones and 64 zeros
    (1, 4096, 12, 1 + 1),
    (3, 4096, 10, 3 + 4),  # ⌊log₂ 1365⌋ = 10; ⌈4096/1024⌉ = 4
    (2048, 4096, 1, 2048 + 2048),
    (3000, 4096, 0, 3000 + 4096),  # K > C/2: no low bits
    (5, 7, 0, 5 + 7),
    (7, 7, 0, 7 + 7),
    (1, 1, 0, 1 + 1),
])
def test_elias_fano_widths(k: int, chunk: int, low: int, high: int) -> None:
    assert elias_fano.low_bits(k, chunk) == low
    assert elias_fano.high_bits(k, chunk) == high
    assert elias_fano.chunk_bits(k, chunk) == k * low + high


def test_elias_fano_stream_sizes_in_bytes() -> None:
    assert elias_fano.stream_sizes(3, 64, 4096) == (3 * 64 * 6 // 8, 3 * 128 // 8)
    assert elias_fano.stream_sizes(1, 3, 4096) == (4, 1)  # 30 low bits → 4 bytes; 7 high bits → 1 byte
    assert elias_fano.stream_sizes(2, 3000, 4096) == (0, -(-2 * 7096 // 8))  # no low stream at all
    assert elias_fano.stream_sizes(0, 64, 4096) == (0, 0)


@pytest.mark.parametrize("chunk,bits", [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (4096, 12), (4097, 13), (1 << 24, 24)])
def test_index_bits(chunk: int, bits: int) -> None:
    assert index_bits(chunk) == bits


@pytest.mark.parametrize("k,chunk,coded", [
    (64, 4096, True),  # 8 bits a position against 12
    (1, 4096, False),  # 14 bits against 12
    (2, 4096, False),  # 2·11 + (2 + 2) = 26 bits against 24
    (4096, 4096, True),  # 8192 against 49152
    (0, 4096, False),
])
def test_elias_fano_only_where_it_is_smaller(k: int, chunk: int, coded: bool) -> None:
    assert uses_elias_fano(k, chunk) is coded


def test_topk_spec_and_locality() -> None:
    assert TopKCompression(64, 4096).spec == "topk:64/4096"
    assert TopKCompression(64, 4096, 2).spec == "topk:64/4096+q2"
    assert TopKCompression(32, 4096, 2, rotated=True).spec == "topk:32/4096+rot2"
    assert TopKCompression(64, 4096).chunk_local and TopKCompression(64, 4096, 2).chunk_local
    assert not TopKCompression(64, 4096, 4).chunk_local and not TopKCompression(64, 4096, 2, rotated=True).chunk_local
    codec = TopKCompression(64, 4096)
    assert (codec.kept(10), codec.kept(64), codec.kept(10_000)) == (10, 64, 64)


@pytest.mark.parametrize("args", [(1, 1), (1, 1 << 24), (4096, 4096), (1, 16, 1, True), (1, 16, 8, True), (1, 16, 8), (1, 16, None)])
def test_topk_accepts_the_edges_of_its_range(args: tuple) -> None:
    TopKCompression(*args)


@pytest.mark.parametrize("args,message", [
    ((1, 0), r"topk chunk size must be in 1\.\.2\*\*24, got 0"),
    ((1, (1 << 24) + 1), r"chunk size must be in 1\.\.2\*\*24"),
    ((0, 16), r"topk must keep between 1 and C=16 values per chunk, got K=0"),
    ((17, 16), r"got K=17"),
    ((1, 16, 3, True), r"topk rotated values take 8, 4, 2 or 1 bits, got 3"),
    ((1, 16, None, True), r"rotated values take"),
    ((1, 16, 1), r"topk values can be quantized to 8, 4 or 2 bits, got 1"),
])
def test_topk_refuses_settings_outside_its_range(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TopKCompression(*args)
