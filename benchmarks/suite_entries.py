"""The suite's entries: which benchmark, with which arguments at each scale, and how long it takes.

One entry is one process and one results file, ``NAME.json`` (``{out}`` in the arguments is its
path). ``quick`` must fit about 45 minutes on 2 cores in all: its settings are smaller versions of
``full`` (fewer steps, rounds, codecs, attacks), keep 3 seeds wherever the benchmark makes a
quality claim, and keep every baseline a table divides by in the same process. ``full`` is what the
docs quote. ``minutes`` are estimates for the 2-core machine: the quick ones from the timed quick
suite there (``benchmarks/results/quick/suite.json``, rounded up), the full ones from the results
files they replace. ``--list`` adds them up.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

SEEDS = "0,1,2"


@dataclass(frozen=True)
class Entry:
    """One benchmark run of the suite.

    :param name: the entry's name, also its results file's (``NAME.json``)
    :param module: what ``python -m`` runs
    :param quick: arguments at quick scale (None: not at this scale; ``why_not`` says why)
    :param full: arguments at full scale
    :param minutes: estimated minutes per scale
    :param docs: the tables or claims its numbers feed (one line)
    :param root: needs root (network namespaces, tc)
    """

    name: str
    module: str
    quick: tuple[str, ...] | None
    full: tuple[str, ...] | None
    minutes: dict[str, float]
    docs: str
    root: bool = False
    why_not: dict[str, str] = field(default_factory=dict)

    def args(self, scale: str) -> tuple[str, ...] | None:
        return {"quick": self.quick, "full": self.full}[scale]


def _a(line: str) -> tuple[str, ...]:
    """Arguments from one shell-quoted line, with ``--out {out}`` first."""
    return ("--out", "{out}", *shlex.split(line))


CHURN_FULL_ONLY = "full scale only: kills come every 45 s, a run needs minutes per seed to see any"
CONVERGENCE_QUICK = "ddp,hivemind,hivemind-8bit,diloco,sparseloco"
ENTRIES: tuple[Entry, ...] = (
    Entry("codecs", "benchmarks.codecs", _a("--quick"), _a("--numel 25000000"), {"quick": 0.5, "full": 15},
          "Compression: codec speed, bits per parameter and error, beside hivemind's Float16 and 8-bit codecs"),
    Entry("codec_speed", "benchmarks.codecs", _a("--codecs fp16;q8;topk:64/4096+q2 --numel 25000000"),
          _a("--codecs fp16;q8;topk:64/4096+q2 --numel 25000000 --runs 9"), {"quick": 1, "full": 2},
          "Compression, speed: fp16 and q8 against hivemind's Float16 and 8-bit codecs, topk+q2 against torch.topk, on 25M values"),
    Entry("throughput", "benchmarks.throughput", _a("--model tiny --steps 20 --warmup 3 --threads 1"),
          _a("--model tiny,small --steps 80 --warmup 5 --threads 1 --repeats 2"), {"quick": 0.5, "full": 10},
          "Benchmarks: bare training loop against a node join daemon (bare and daemon alternated per pair)"),
    Entry("scale", "benchmarks.scale", _a("--peers 4,8 --rounds 3 --timeout 60"), _a("--peers 8,16,32 --timeout 180"),
          {"quick": 0.5, "full": 25}, "Benchmarks, scale: bytes, round time, DHT requests and memory per peer; simulated rows"),
    Entry("scale_groups", "benchmarks.scale", _a("--peers 12 --max-group-size 4 --rounds 3 --timeout 60"),
          _a("--peers 16,32 --max-group-size 8 --rounds 5 --timeout 60"), {"quick": 1, "full": 15},
          "Benchmarks, scale: bounded groups (--max-group-size) and the replicas' spread"),
    Entry("inner_optimizer", "benchmarks.inner_optimizer", _a(f"--seeds {SEEDS} --rounds 6 --inner-steps 10"),
          _a(f"--seeds {SEEDS}"), {"quick": 2.5, "full": 32},
          "Inner optimizer and lr schedule: AdamW/Muon x constant/cosine x none/q2, mean ± std over 3 seeds"),
    Entry("replica_gap", "benchmarks.replica_gap",
          _a(f"--seeds {SEEDS} --nodes 2,8 --total-steps 150 --h 30,50 --outer 1:0.7 --sparseloco --jobs 2"),
          _a(f"--seeds {SEEDS} --nodes 2,4,8 --total-steps 600 --h 30,50 --outer 1:0.7 --sparseloco --jobs 2"),
          {"quick": 5, "full": 35},
          "Replicas against one process on the same tokens: dense DiLoCo at H 30 and 50, SparseLoCo at its defaults, by replica count"),
    Entry("inner_optimizer_lr3e-3", "benchmarks.inner_optimizer",
          _a(f"--seeds {SEEDS} --rounds 6 --inner-steps 10 --codecs none --lr 3e-3"), _a(f"--seeds {SEEDS} --codecs none --lr 3e-3"),
          {"quick": 1, "full": 14}, "Inner optimizer and lr schedule: the --lr 3e-3 row"),
    Entry("byzantine_diloco", "benchmarks.byzantine",
          _a(f"--scale quick --rounds 4 --inner-steps 8 --configs 4:1 --seeds {SEEDS} --algorithms diloco "
             "--aggregators mean,centered-clip --attacks sign,alie,ipm"),
          _a(f"--scale quick --seeds {SEEDS} --algorithms diloco --aggregators mean,centered-clip"),
          {"quick": 2.5, "full": 60}, "Byzantine peers: DiLoCo under each attack, plain mean against centered clip"),
    Entry("byzantine_sparseloco", "benchmarks.byzantine",
          _a(f"--scale quick --rounds 4 --inner-steps 8 --configs 4:1 --seeds {SEEDS} --algorithms sparseloco "
             "--aggregators sparse-mean,sparse-clip --attacks sign,alie,concentrate"),
          _a(f"--scale quick --seeds {SEEDS} --algorithms sparseloco"),
          {"quick": 3, "full": 72}, "Byzantine peers: SparseLoCo under each attack, sparse mean against sparse clip"),
    Entry("recovery", "benchmarks.recovery", _a("--quick --steps 300"), _a(""), {"quick": 2, "full": 30},
          "Lost stages: recovery strategies under simulated failures, steps and seconds to target (interpolated)"),
    Entry("churn", "benchmarks.recovery", None, _a("--churn --minutes 5 --nodes 8 --seeds 0 1 2"), {"full": 35},
          "Lost stages: real-process churn with restarts, killed and calm runs alternated per seed",
          why_not={"quick": CHURN_FULL_ONLY}),
    Entry("churn_no_restart", "benchmarks.recovery", None, _a("--churn --no-restart --minutes 4 --nodes 8 --seeds 0 1 2"),
          {"full": 28}, "Lost stages: churn without restarts (stages rebuilt by CheckFree)",
          why_not={"quick": CHURN_FULL_ONLY}),
    Entry("convergence", "benchmarks.convergence", _a(f"--quick --steps 240 --seeds {SEEDS} --configs {CONVERGENCE_QUICK}"),
          _a(f"--quick --seeds {SEEDS}"), {"quick": 6.5, "full": 100},
          "Benchmarks, convergence: every algorithm against ddp and hivemind (plain and 8-bit), 3 seeds alternated"),
    Entry("forging", "benchmarks.convergence",
          _a(f"--quick --nodes 3 --steps 240 --inner-steps 15 --seeds {SEEDS} --configs diloco,diloco-forged,diloco-again "
             "--variant diloco-forged=diloco: --variant diloco-again=diloco: --forged diloco-forged --no-dense-per-h"),
          _a(f"--model tiny --nodes 4 --steps 600 --inner-steps 30 --batch-size 16 --seeds {SEEDS} --configs diloco,diloco-forged "
             "--variant diloco-forged=diloco: --forged diloco-forged --no-dense-per-h"),
          {"quick": 4, "full": 45}, "Robustness: DiLoCo beside a forging peer against a clean run, 3 seeds alternated "
          "(quick: and the clean run again, its noise floor)"),
    Entry("sparse_gap", "benchmarks.convergence", None,
          _a(f"--model tiny --nodes 4 --steps 600 --inner-steps 30 --batch-size 16 --seeds {SEEDS} "
             "--configs diloco,noloco,sparseloco,sparseloco-h20 --variant 'sparseloco-h20=sparseloco:--inner-steps 20'"),
          {"full": 120}, "Benchmarks: SparseLoCo's gap to dense DiLoCo, each against dense DiLoCo at its own H",
          why_not={"quick": "full scale only: 4 tiny nodes x 600 steps take ~7 min a run; the quick convergence entry "
                            "compares diloco and sparseloco at equal H"}),
    Entry("frontier", "benchmarks.frontier",
          _a(f"--model nano --nodes 2 --steps 240 --inner-steps 30 --codecs none,q2,rot2 --seeds {SEEDS} --config-timeout 600"),
          _a(f"--seeds {SEEDS}"), {"quick": 3, "full": 190},
          "Compression, quality for bytes: held-out loss against averaging bytes per codec, dense at the same H"),
    Entry("zo", "benchmarks.zo", _a("--quick --peers 1,2 --pretrain-steps 200 --steps 100"), _a(""), {"quick": 1, "full": 30},
          "Zeroth-order fine-tuning: held-out loss before and after, bytes per step, 1/2/4 peers"),
    Entry("pipeline_swarm", "benchmarks.pipeline_swarm", _a("--quick --duration 45 --codec-duration 25 --budget-duration 45"),
          _a(""), {"quick": 5.5, "full": 18},
          "Benchmarks, pipelines: rebalancing against the optimal assignment, activation codecs, loss at equal batches"),
    Entry("bandwidth_cap", "benchmarks.bandwidth_cap", _a("--seconds 20 --cap-mbit 2 0"), _a("--seconds 60 --cap-mbit 2 0"),
          {"quick": 1.5, "full": 5}, "Running a node for months: --max-upload-mbit on the wire, capped and uncapped", root=True),
    Entry("thin_nat", "benchmarks.thin_links", _a("--nat --rates 20 --codecs none,topk:64/4096+q2 --duration 45"),
          _a("--nat --rates 20 --codecs none,topk:64/4096+q2 --duration 120"), {"quick": 4, "full": 10},
          "Benchmarks, NAT rows: direct peers against homes behind NAT through a relay", root=True),
    Entry("thin_links", "benchmarks.thin_links", None,
          _a("--rates 20,5 --codecs none,topk:64/4096+q2 --duration 120 --partition"), {"full": 12},
          "Robustness: rounds behind tc tbf links and a partition healed", root=True,
          why_not={"quick": "full scale only: two-minute runs per rate and codec"}),
    Entry("thin20_race", "benchmarks.convergence", None,
          _a(f"--link-mbit 20 --model tiny --nodes 2 --steps 600 --baseline-steps 300 --inner-steps 30 --seeds {SEEDS} "
             "--configs ddp,hivemind,hivemind-fp16,hivemind-8bit,diloco,diloco-q2,sparseloco --variant 'diloco-q2=diloco:--compression q2'"),
          {"full": 240}, "Benchmarks, thin-link race at 20 Mbit/s: time to ddp's loss against ddp and hivemind's best",
          root=True, why_not={"quick": "full scale only: ddp alone spends ~9 min a seed crossing the 20 Mbit/s link"}),
    Entry("thin5_race", "benchmarks.convergence", None,
          _a("--link-mbit 5 --model tiny --nodes 2 --steps 600 --baseline-steps 300 --inner-steps 30 --seeds 0 "
             "--configs ddp,hivemind,hivemind-8bit,diloco,diloco-q2,sparseloco --variant 'diloco-q2=diloco:--compression q2'"),
          {"full": 60}, "Benchmarks, thin-link race at 5 Mbit/s (one seed: ddp alone takes ~36 min)",
          root=True, why_not={"quick": "full scale only: ddp alone spends ~36 min crossing the 5 Mbit/s link"}),
)
