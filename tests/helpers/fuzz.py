"""Mutation fuzzing of every decoder a peer's bytes reach: frames, envelopes, tensor payloads, codec
payloads, DHT records, and the request and reply sides of every locomesh protocol handler.

Each target takes bytes; the only acceptable outcomes are success or a typed refusal
(:class:`protocol.ProtocolError`, or ``EOFError`` for a stream that simply ended). Anything else is
a crash; an input that does not finish within the time bound is a hang.

    python -m tests.helpers.fuzz --iterations 100000 [--seed 0] [--out report.json]

``tests/unit/test_fuzz.py`` runs a short seeded pass of the same code in ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from compression import Payload, get_codec
from gossip.exchange import Contribution, RoundExchange
from gossip.state_server import StateServer
from gossip.state_transfer import StateSnapshot, download_state
from node.runtime.status_service import StatusService
from protocol import ProtocolError, decode_message, encode_message, read_frame, tensor_from_wire, tensor_to_wire
from protocol.records import PeerRecord, RoundEntry
from tests.helpers.memory_transport import MemoryTransport, canned_stream, frames

TIME_BOUND_S = 5.0
CODECS = ["none", "fp16", "q8", "q4", "q2", "int8-block", "topk:64/4096+q2", "topk:8/64", "dct:8/64", "seed:r=16"]
PART_SHAPES = [(8, 8), (5,), (3, 70)]


@dataclass
class Target:
    name: str
    run: Callable[[bytes], Awaitable[None]]
    seeds: list[bytes]


@dataclass
class Stats:
    inputs: int = 0
    accepted: int = 0
    refused: int = 0
    crashes: list[dict] = field(default_factory=list)
    hangs: list[dict] = field(default_factory=list)
    max_seconds: float = 0.0


def build_targets() -> list[Target]:
    g = torch.Generator().manual_seed(0)
    targets: list[Target] = []

    async def envelope(data: bytes) -> None:
        decode_message(data, max_size=1 << 20)

    async def frame(data: bytes) -> None:
        stream, _ = canned_stream(data)
        while True:
            try:
                await read_frame(stream.reader, 1 << 20)
            except EOFError:  # a clean end between frames
                return

    targets.append(Target("envelope", envelope, [encode_message("fetch", {"run_id": "r", "round": 3, "codec": "none"})]))
    targets.append(Target("frames", frame, [frames(("a", {"x": b"123"}), ("b", {}))]))

    async def tensor(data: bytes) -> None:
        msg = decode_message(data, max_size=1 << 20)
        tensor_from_wire(msg.body.get("t"), max_numel=1 << 20)

    seeds = [encode_message("t", {"t": tensor_to_wire(torch.randn(3, 4, generator=g).to(dt))}) for dt in (torch.float32, torch.bfloat16, torch.int64)]
    targets.append(Target("tensor", tensor, seeds))

    for spec in CODECS:
        codec = get_codec(spec)
        x = torch.randn(PART_SHAPES[2], generator=g)

        async def payload(data: bytes, codec=codec, shape=tuple(x.shape)) -> None:
            p = Payload.from_bytes(data, max_bytes=1 << 20, max_numel=1 << 20, expected_shape=shape)
            out = codec.decode(p)
            assert tuple(out.shape) == shape, "decode returned the wrong shape without an error"

        targets.append(Target(f"payload:{spec}", payload, [codec.encode(x).to_bytes()]))

    async def records(data: bytes) -> None:
        msg = decode_message(data, max_size=1 << 20)
        PeerRecord.from_value(msg.body.get("peer"))
        RoundEntry.from_value(msg.body.get("entry"))

    rec = PeerRecord(peer_id="p", round=2, maddrs=["/ip4/1.2.3.4/tcp/5"]).to_value()
    targets.append(Target("records", records, [encode_message("r", {"peer": rec, "entry": {"peer_id": "p", "samples": 8, "codec": "none"}})]))

    # --- protocol handlers, server side: the bytes are what a client sends ------------------------
    transport = MemoryTransport(peer_id="fuzzer-self", reply=b"")
    exchange = RoundExchange(transport, "run", "topk:8/64+q2", PART_SHAPES, serve_timeout=0.05)  # type: ignore[arg-type]
    parts = [torch.randn(s, generator=g) for s in PART_SHAPES]
    blobs, decoded = exchange.encode(5, parts)
    exchange.publish(Contribution(5, 32, "fp", exchange.wire, blobs, "me", decoded))

    async def average_server(data: bytes) -> None:
        stream, _ = canned_stream(data)
        await exchange._handle(stream)

    targets.append(Target("handler:average", average_server, [frames(("fetch", {"run_id": "run", "round": 5, "codec": exchange.wire}))]))

    state = StateServer(transport, "run", progress=lambda: 3)  # type: ignore[arg-type]
    tensors = {"params": [torch.randn(s, generator=g) for s in PART_SHAPES], "outer_momentum": [torch.zeros(s) for s in PART_SHAPES]}
    state.publish(StateSnapshot(round=5, tensors=tensors, fingerprint="fp", meta={"model": "x"}))

    async def state_server(data: bytes) -> None:
        stream, _ = canned_stream(data)
        await state._handle(stream)

    targets.append(Target("handler:state", state_server, [frames(("get_state", {"run_id": "run"}))]))

    status = StatusService(transport, lambda: {"round": 1})  # type: ignore[arg-type]

    async def status_server(data: bytes) -> None:
        stream, _ = canned_stream(data)
        await status._handle(stream)

    targets.append(Target("handler:status", status_server, [frames(("get_status", {}))]))

    # --- protocol handlers, client side: the bytes are what a (hostile) server replies -----------
    async def served(handler, request: bytes) -> bytes:
        stream, sink = canned_stream(request)
        await handler(stream)
        return bytes(sink.data)

    good_contribution = asyncio.run(served(exchange._handle, frames(("fetch", {"run_id": "run", "round": 5, "codec": exchange.wire}))))
    good_state = asyncio.run(served(state._handle, frames(("get_state", {"run_id": "run"}))))

    async def average_client(data: bytes) -> None:
        transport.reply = data
        c = await exchange.fetch("server", 5)
        assert all(torch.isfinite(t).all() for t in c.decoded), "non-finite values accepted"

    targets.append(Target("client:average", average_client, [good_contribution]))

    layout = {name: [(tuple(t.shape), t.dtype) for t in ts] for name, ts in tensors.items()}

    async def state_client(data: bytes) -> None:
        transport.reply = data
        await download_state(transport, "server", "run", layout)  # type: ignore[arg-type]

    targets.append(Target("client:state", state_client, [good_state]))
    return targets


def mutate(data: bytes, rng: random.Random, seeds: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and buf:  # flip bits
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(buf))
                buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # truncate
            del buf[rng.randrange(len(buf)) :]
        elif op == 2:  # insert random bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and len(buf) >= 4:  # rewrite a 4-byte big-endian length anywhere
            i = rng.randrange(len(buf) - 3)
            buf[i : i + 4] = rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32), len(buf)]).to_bytes(4, "big")
        elif op == 4 and buf:  # overwrite a span with interesting bytes
            i = rng.randrange(len(buf))
            span = rng.choice([b"\xff" * 4, b"\x00" * 4, b"\xc1", b"\xdb\xff\xff\xff\xff", b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00"])
            buf[i : i + len(span)] = span
        elif op == 5 and buf:  # duplicate a chunk
            i, j = sorted(rng.randrange(len(buf) + 1) for _ in range(2))
            buf[j:j] = buf[i:j]
        elif op == 6:  # splice with another seed
            other = rng.choice(seeds)
            cut = rng.randrange(len(other) + 1)
            buf = buf[: rng.randrange(len(buf) + 1)] + bytearray(other[cut:])
        else:  # random bytes
            buf = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(buf)


def run_target(target: Target, iterations: int, seed: int, stats: Stats) -> None:
    rng = random.Random(f"{seed}:{target.name}")
    loop = asyncio.new_event_loop()
    try:
        for i in range(iterations):
            data = target.seeds[0] if i == 0 else mutate(rng.choice(target.seeds), rng, target.seeds)
            started = time.perf_counter()
            try:
                loop.run_until_complete(asyncio.wait_for(target.run(data), TIME_BOUND_S))
                stats.accepted += 1
            except (ProtocolError, EOFError):
                stats.refused += 1
            except asyncio.TimeoutError:
                stats.hangs.append({"target": target.name, "input": data.hex()[:2000]})
            except Exception as e:  # anything else is a crash: record it with the input
                stats.crashes.append({"target": target.name, "error": f"{type(e).__name__}: {e}", "input": data.hex()[:2000],
                                      "trace": traceback.format_exc()[-1500:]})
            stats.inputs += 1
            stats.max_seconds = max(stats.max_seconds, time.perf_counter() - started)
    finally:
        loop.close()


def fuzz(iterations: int, seed: int = 0, only: str | None = None) -> dict:
    """Run ``iterations`` mutated inputs through every target (or those whose name contains ``only``)."""
    torch.set_num_threads(1)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.time()
    per_target: dict[str, dict] = {}
    total = Stats()
    for target in build_targets():
        if only and only not in target.name:
            continue
        stats = Stats()
        run_target(target, iterations, seed, stats)
        per_target[target.name] = {"inputs": stats.inputs, "accepted": stats.accepted, "refused": stats.refused,
                                   "crashes": len(stats.crashes), "hangs": len(stats.hangs), "max_seconds": round(stats.max_seconds, 4)}
        total.inputs += stats.inputs
        total.crashes += stats.crashes
        total.hangs += stats.hangs
        total.max_seconds = max(total.max_seconds, stats.max_seconds)
    return {
        "iterations_per_target": iterations,
        "seed": seed,
        "inputs": total.inputs,
        "crashes": total.crashes,
        "hangs": total.hangs,
        "max_seconds_per_input": round(total.max_seconds, 4),
        "max_rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024, 1),
        "wall_s": round(time.time() - started, 1),
        "targets": per_target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10000, help="inputs per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="run only targets whose name contains this")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    report = fuzz(args.iterations, args.seed, args.only)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    summary = {k: v for k, v in report.items() if k not in ("crashes", "hangs", "targets")}
    print(json.dumps({**summary, "crashes": len(report["crashes"]), "hangs": len(report["hangs"])}, indent=2))
    for crash in report["crashes"][:5]:
        print(f"CRASH {crash['target']}: {crash['error']}\n{crash['trace']}", file=sys.stderr)
    sys.exit(1 if report["crashes"] or report["hangs"] else 0)


if __name__ == "__main__":
    main()
