"""Codec throughput, size and accuracy on one large tensor, next to hivemind's codecs.

    python -m benchmarks.codecs --numel 25000000 --out runs/codecs.json
    python -m benchmarks.codecs --quick            # 1M values, a few seconds per codec

For every codec: encode and decode speed in GB/s of float32 input (numel·4 bytes / median seconds of
``--runs`` timed runs after one warm-up), once with ``torch.set_num_threads(1)`` and once with all
threads; bits per parameter (8·wire bytes / numel, headers included) and the relative L2 error
‖x̂ − x‖ / ‖x‖. Encode is ``codec.encode(x).to_bytes()``, decode is ``codec.decode(Payload.from_bytes(b))``:
bytes to bytes, as on the wire. hivemind's Float16Compression and Uniform8BitQuantization are timed
the same way (``compress(...).SerializeToString()`` / ``ParseFromString`` + ``extract``).

The input is a standard-normal float32 matrix as close to square as the element count allows, so the
chunked codecs use their 2-D tiling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from compression import Payload, get_codec

DEFAULT_SPECS = [
    "none",
    "fp16",
    "bf16",
    "q8",
    "q4",
    "q2",
    "int8-block",
    "topk:64/4096",
    "topk:64/4096+q2",
    "dct:32/4096+q2",
    "seed:r=8",
    "subspace:k=64,d={cols}",
]


def matrix_shape(numel: int) -> tuple[int, int]:
    """(rows, cols) with rows·cols = numel and cols the divisor closest to √numel from below."""
    cols = math.isqrt(numel)
    while numel % cols:
        cols -= 1
    return numel // cols, cols


def median_seconds(fn: Callable[[], Any], runs: int) -> float:
    """Median wall time of ``runs`` calls after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(encode: Callable[[], bytes], decode: Callable[[bytes], torch.Tensor], x: torch.Tensor, runs: int,
            threads: int) -> dict[str, float]:
    """Encode/decode GB/s at one thread and at ``threads``, bits per parameter and relative error."""
    gigabytes = x.numel() * 4 / 1e9
    data = encode()
    out = decode(data)
    result = {
        "bits_per_param": 8 * len(data) / x.numel(),
        "wire_bytes": len(data),
        "rel_error": float((out.double() - x.double()).norm() / x.double().norm()),
    }
    for suffix, n_threads in (("", threads), ("_1t", 1)):
        torch.set_num_threads(n_threads)
        result[f"encode_gbps{suffix}"] = gigabytes / median_seconds(encode, runs)
        result[f"decode_gbps{suffix}"] = gigabytes / median_seconds(lambda: decode(data), runs)
    torch.set_num_threads(threads)
    return result


def bench_codec(spec: str, x: torch.Tensor, runs: int, threads: int) -> dict[str, float]:
    codec = get_codec(spec)
    return measure(
        lambda: codec.encode(x).to_bytes(),
        lambda data: codec.decode(Payload.from_bytes(data, max_bytes=1 << 31)),
        x,
        runs,
        threads,
    )


def bench_hivemind(x: torch.Tensor, runs: int, threads: int) -> dict[str, dict[str, float]]:
    """hivemind's float16 and uniform 8-bit codecs, serialised to bytes and parsed back."""
    warnings.filterwarnings("ignore", category=UserWarning)
    from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
    from hivemind.proto import runtime_pb2

    info = CompressionInfo.from_tensor(x)
    out: dict[str, dict[str, float]] = {}
    theirs = {"Float16Compression": Float16Compression(), "Uniform8BitQuantization": Uniform8BitQuantization()}
    for name, codec in theirs.items():

        def decode(data: bytes, codec: Any = codec) -> torch.Tensor:
            message = runtime_pb2.Tensor()
            message.ParseFromString(data)
            return codec.extract(message)

        out[name] = measure(lambda codec=codec: codec.compress(x, info).SerializeToString(), decode, x, runs, threads)
    return out


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def print_table(results: dict[str, Any]) -> None:
    columns = ("enc GB/s", "dec GB/s", "enc 1t", "dec 1t", "bits/p", "rel err")
    header = f"{'codec':34s} " + " ".join(f"{c:>9s}" for c in columns)
    print(header)
    print("-" * len(header))
    rows = list(results["codecs"].items()) + [(f"hivemind {k}", v) for k, v in results["hivemind"].items()]
    for name, r in rows:
        print(
            f"{name:34s} {r['encode_gbps']:9.2f} {r['decode_gbps']:9.2f} {r['encode_gbps_1t']:9.2f} "
            f"{r['decode_gbps_1t']:9.2f} {r['bits_per_param']:9.4f} {r['rel_error']:9.2e}"
        )
    for ours, theirs in (("fp16", "Float16Compression"), ("q8", "Uniform8BitQuantization")):
        if ours in results["codecs"] and theirs in results["hivemind"]:
            print(f"{ours} vs hivemind {theirs}: " + ", ".join(
                f"{key} ×{results['codecs'][ours][key] / results['hivemind'][theirs][key]:.2f}"
                for key in ("encode_gbps", "decode_gbps", "encode_gbps_1t", "decode_gbps_1t")
            ))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000, help="elements in the test tensor (default 25M)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per measurement; the median is kept (≥ 5)")
    parser.add_argument("--codecs", default=";".join(DEFAULT_SPECS), help="semicolon-separated codec specs")
    parser.add_argument("--no-hivemind", action="store_true", help="skip the hivemind comparison")
    parser.add_argument("--quick", action="store_true", help="1M elements and 5 runs: a smoke test")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.numel = min(args.numel, 1_000_000)
    if args.numel < 1 or args.runs < 1:
        parser.error("--numel and --runs must be positive")

    threads = torch.get_num_threads()
    rows, cols = matrix_shape(args.numel)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    results: dict[str, Any] = {
        "numel": args.numel,
        "shape": [rows, cols],
        "runs": args.runs,
        "codecs": {},
        "hivemind": {},
        "machine": machine_info(threads),
    }
    for spec in args.codecs.split(";"):
        spec = spec.strip().format(cols=cols)
        print(f"… {spec}", file=sys.stderr, flush=True)
        results["codecs"][spec] = bench_codec(spec, x, args.runs, threads)
    if not args.no_hivemind:
        print("… hivemind", file=sys.stderr, flush=True)
        results["hivemind"] = bench_hivemind(x, args.runs, threads)
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
