"""Codec throughput, size and accuracy on one large tensor, next to hivemind's codecs.

    python -m benchmarks.codecs --numel 25000000 --out runs/codecs.json
    python -m benchmarks.codecs --quick            # 1M values, a few seconds per codec
    python -m benchmarks.codecs --codecs "rot2;topk:64/4096+q2" --no-hivemind   # only some codecs

For every codec: encode and decode speed in GB/s of float32 input (numel·4 bytes / median seconds of
``--runs`` timed runs after one warm-up), once with ``torch.set_num_threads(1)`` and once with all
threads; bits per parameter (8·wire bytes / numel, headers included) and the relative L2 error
‖x̂ − x‖ / ‖x‖. Encode is ``codec.encode(x).to_bytes()``, decode is ``codec.decode(Payload.from_bytes(b))``:
bytes to bytes, as on the wire. hivemind's Float16Compression and Uniform8BitQuantization are timed
the same way (``compress(...).SerializeToString()`` / ``ParseFromString`` + ``extract``), in one process
with the daemon's allocator settings (``compression.memory.tune_allocator``). The bare
``torch.topk(k=64)`` over rows of 4096 values is timed as a yardstick (``baselines``): a codec whose
encode and decode both beat it costs less than the selection step of top-k alone. Each codec is also
raced against it on one thread in alternating rounds (``encode_vs_topk_1t``, ``decode_vs_topk_1t``: the
median over rounds of topk seconds / codec seconds per value, > 1 when the codec is faster), which
stays meaningful when other work on the machine slows some minutes more than others.

The timed input is a standard-normal float32 matrix as close to square as the element count allows,
so the chunked codecs use their 2-D tiling. Errors (normalised squared error ‖x̂ − x‖²/‖x‖² and
relative L2 error) are also measured on a Student-t(2) matrix (heavy tails) and a rank-4 matrix of
the same shape (``errors``).
"""

from __future__ import annotations

import argparse
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

from benchmarks import results_io
from compression import Payload, get_codec, memory

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
    "topk:64/4096+rot2",
    "rot1",
    "rot2",
    "rot4",
    "rot8",
    "dct:32/4096+q2",
    "seed:r=8",
    "seed:r=64",
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
            suffix: str) -> dict[str, float]:
    """Encode/decode GB/s at the current thread count (keys end in ``suffix``), bits per parameter and
    relative error."""
    gigabytes = x.numel() * 4 / 1e9
    data = encode()
    out = decode(data)
    return {
        "bits_per_param": 8 * len(data) / x.numel(),
        "wire_bytes": len(data),
        "rel_error": float((out.double() - x.double()).norm() / x.double().norm()),
        f"encode_gbps{suffix}": gigabytes / median_seconds(encode, runs),
        f"decode_gbps{suffix}": gigabytes / median_seconds(lambda: decode(data), runs),
    }


def error_inputs(rows: int, cols: int) -> dict[str, torch.Tensor]:
    """Student-t(2) (Z/√(χ²₂/2), with χ²₂/2 = −ln U) and rank-4 matrices of shape (rows, cols)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(rows, cols, generator=g)
    u = torch.rand(rows, cols, generator=g).clamp_min_(1e-30)
    return {
        "student_t2": z.div_(u.log_().neg_().sqrt_()),
        "low_rank": torch.randn(rows, 4, generator=g) @ torch.randn(4, cols, generator=g),
    }


def errors(roundtrip: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, others: dict[str, torch.Tensor]
           ) -> dict[str, dict[str, float]]:
    """Normalised squared error and relative L2 error of one round trip per input."""
    out: dict[str, dict[str, float]] = {}
    for name, t in {"gaussian": x, **others}.items():
        ref = t.double()
        nse = float((roundtrip(t).double() - ref).square().sum() / ref.square().sum())
        out[name] = {"nse": nse, "rel_l2": math.sqrt(nse)}
    return out


def bench_codec(spec: str, x: torch.Tensor, runs: int, suffix: str, others: dict[str, torch.Tensor] | None
                ) -> dict[str, Any]:
    """One codec's speeds at the current thread count; with ``others``, also its errors and the race."""
    codec = get_codec(spec)

    def roundtrip(t: torch.Tensor) -> torch.Tensor:
        return codec.decode(Payload.from_bytes(codec.encode(t).to_bytes(), max_bytes=1 << 31))

    result: dict[str, Any] = measure(
        lambda: codec.encode(x).to_bytes(),
        lambda data: codec.decode(Payload.from_bytes(data, max_bytes=1 << 31)),
        x,
        runs,
        suffix,
    )
    if others is not None:
        result["errors"] = errors(roundtrip, x, others)
        result.update(race_topk(lambda: codec.encode(x).to_bytes(),
                                lambda data: codec.decode(Payload.from_bytes(data, max_bytes=1 << 31)), x, runs))
    return result


def race_topk(encode: Callable[[], bytes], decode: Callable[[bytes], torch.Tensor], x: torch.Tensor, runs: int
              ) -> dict[str, float]:
    """On one thread, alternate torch.topk(rows of 4096, 64), encode and decode for ``runs`` rounds (after
    a warm-up); per round the speed ratio topk time / codec time per value; the medians of those."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = x.reshape(-1)[: x.numel() // 4096 * 4096].view(-1, 4096)
    data = encode()
    ratios: dict[str, list[float]] = {"encode_vs_topk_1t": [], "decode_vs_topk_1t": []}
    for round_ in range(runs + 1):
        start = time.perf_counter()
        torch.topk(rows, 64, dim=1)
        topk = (time.perf_counter() - start) / rows.numel()
        start = time.perf_counter()
        data = encode()
        middle = time.perf_counter()
        decode(data)
        end = time.perf_counter()
        if round_:
            ratios["encode_vs_topk_1t"].append(topk * x.numel() / (middle - start))
            ratios["decode_vs_topk_1t"].append(topk * x.numel() / (end - middle))
    torch.set_num_threads(threads)
    return {key: statistics.median(values) for key, values in ratios.items()}


def bench_topk(x: torch.Tensor, runs: int, suffix: str) -> dict[str, float]:
    """GB/s of the bare ``torch.topk(rows, 64)`` over rows of 4096 values (the whole rows of ``x``), at the
    current thread count."""
    rows = x.reshape(-1)[: x.numel() // 4096 * 4096].view(-1, 4096)
    gigabytes = rows.numel() * 4 / 1e9
    return {f"gbps{suffix}": gigabytes / median_seconds(lambda: torch.topk(rows, 64, dim=1), runs)}


def bench_hivemind(x: torch.Tensor, runs: int, suffix: str, others: dict[str, torch.Tensor] | None
                   ) -> dict[str, dict[str, Any]]:
    """hivemind's float16 and uniform 8-bit codecs, serialised to bytes and parsed back."""
    warnings.filterwarnings("ignore", category=UserWarning)
    from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
    from hivemind.proto import runtime_pb2

    info = CompressionInfo.from_tensor(x)
    out: dict[str, dict[str, Any]] = {}
    theirs = {"Float16Compression": Float16Compression(), "Uniform8BitQuantization": Uniform8BitQuantization()}
    for name, codec in theirs.items():

        def decode(data: bytes, codec: Any = codec) -> torch.Tensor:
            message = runtime_pb2.Tensor()
            message.ParseFromString(data)
            return codec.extract(message)

        out[name] = measure(lambda codec=codec: codec.compress(x, info).SerializeToString(), decode, x, runs, suffix)
        if others is None:
            continue

        def roundtrip(t: torch.Tensor, codec: Any = codec, decode: Any = decode) -> torch.Tensor:
            return decode(codec.compress(t, CompressionInfo.from_tensor(t)).SerializeToString())

        out[name]["errors"] = errors(roundtrip, x, others)
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
    columns = ("enc GB/s", "dec GB/s", "enc 1t", "dec 1t", "bits/p", "rel err", "nse", "nse t2", "nse lowr")
    header = f"{'codec':34s} " + " ".join(f"{c:>9s}" for c in columns)
    print(header)
    print("-" * len(header))
    rows = list(results["codecs"].items()) + [(f"hivemind {k}", v) for k, v in results["hivemind"].items()]
    for name, r in rows:
        nse = [r.get("errors", {}).get(k, {}).get("nse", float("nan")) for k in ("gaussian", "student_t2", "low_rank")]
        print(
            f"{name:34s} {r['encode_gbps']:9.2f} {r['decode_gbps']:9.2f} {r['encode_gbps_1t']:9.2f} "
            f"{r['decode_gbps_1t']:9.2f} {r['bits_per_param']:9.4f} {r['rel_error']:9.2e} "
            + " ".join(f"{v:9.2e}" for v in nse)
        )
    topk = results["baselines"].get("torch.topk")
    if topk:
        print(f"{'torch.topk k=64, rows of 4096':34s} {topk['gbps']:9.2f} {'':9s} {topk['gbps_1t']:9.2f}")
        for name, r in results["codecs"].items():
            print(f"{name} vs torch.topk (1 thread, raced round by round): encode ×{r['encode_vs_topk_1t']:.2f}, "
                  f"decode ×{r['decode_vs_topk_1t']:.2f}")
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
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.codecs", *argv])

    tuned = memory.tune_allocator()  # the daemon's malloc settings: codecs run inside the daemon
    threads = torch.get_num_threads()
    rows, cols = matrix_shape(args.numel)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    results: dict[str, Any] = {
        "numel": args.numel,
        "shape": [rows, cols],
        "runs": args.runs,
        "codecs": {},
        "hivemind": {},
        "baselines": {},
        "machine": {**machine_info(threads), "daemon_allocator": tuned},
    }
    others = error_inputs(rows, cols)
    # all threads first, then one: going back up from one thread slowed later 2-thread runs ~2.5× here
    for suffix, n_threads in (("", threads), ("_1t", 1)):
        torch.set_num_threads(n_threads)
        extras = others if suffix else None  # errors and races once, on one thread
        print(f"… torch.topk ({n_threads} threads)", file=sys.stderr, flush=True)
        results["baselines"].setdefault("torch.topk", {}).update(bench_topk(x, args.runs, suffix))
        for spec in args.codecs.split(";"):
            spec = spec.strip().format(cols=cols)
            print(f"… {spec} ({n_threads} threads)", file=sys.stderr, flush=True)
            results["codecs"].setdefault(spec, {}).update(bench_codec(spec, x, args.runs, suffix, extras))
        if not args.no_hivemind:
            print(f"… hivemind ({n_threads} threads)", file=sys.stderr, flush=True)
            for name, row in bench_hivemind(x, args.runs, suffix, extras).items():
                results["hivemind"].setdefault(name, {}).update(row)
    torch.set_num_threads(threads)
    print_table(results)
    if args.out:
        results_io.write(args.out, results, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
