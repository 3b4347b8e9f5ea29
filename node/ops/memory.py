"""How much memory a ``node join`` will need, against what this machine has free: fail at start, not hours later.

:func:`estimate` adds up, for the whole model or for one pipeline stage, the parameters, their gradients, the
inner AdamW's two states, the outer state (DiLoCo's agreed weights φ and outer momentum, on ``--outer-device``),
the activations of one micro-batch (per transformer block of the GPT or Llama family, with or without
activation checkpointing), the codec's error-feedback residual and round buffers, and the process's own
runtime. :func:`check_fit` compares the sums with free RAM (``MemAvailable``) and free VRAM
(``torch.cuda.mem_get_info``) and, when something does not fit, says which settings would: the largest
``--micro-batch-size``, ``--activation-checkpointing``, ``--outer-device cpu``, a smaller ``--model``.

The activation model counts the elements autograd keeps per token of a block (scaled-dot-product
attention keeps no T×T matrix), fitted to the peak RSS of CPU training over 2 to 10 blocks: GPT 20·d
(analytically 17·d: two LayerNorms' inputs and outputs, q/k/v, the attention output and its copy, the
4·d MLP hidden before and after GELU; the rest is the attention kernel's contiguous copies), Llama
24·d + 3·d_ff (fp32 RMSNorm intermediates, q and k/v after RoPE and grouping, SwiGLU's gate, SiLU, up
and product); plus the logits, their log-softmax and both gradients, and two blocks' worth of gradients
in flight. ``tests/integration/test_memory.py`` checks the estimate against real training on the CPU.

Measured (peak RSS growth of 3 CPU steps / the estimate's training rows, MiB): small b8 ctx128 432/518,
the same checkpointed 371/370, with micro-batch 2 339/324; llama-tiny b16 241/238; tiny b32 299/293. A whole
``node join --model small --batch-size 8 --context 128`` (6 steps, 2 rounds): peak RSS 1.17 GiB, estimated 1.27 GiB.
Those rows counted 2 × the parameters of optimizer temporaries; on the CPU they are now two of the largest tensors
(:func:`_step_temporaries`), which leaves small b8 ctx128 at 426/416 and shows what the old row hid: llama-20m b16
micro-batch 8 checkpointed grows 813–912 MiB against 632 estimated (activations under checkpointing are counted
short). Two ``llama-150m`` daemons (``docs/benchmarks.md``, the wire section) peaked at 0.76–0.82 × the whole estimate.
The CUDA side (bf16 activations taken as 2.5 bytes an element, 10 % slack), against ``max_memory_allocated`` on one H100
at batch 16 (``benchmarks/results/gpu/throughput_h100.json``): small 876/594, medium 6240/3967, llama-150m 24165/22510 MiB.

``LOCOMESH_FAKE_FREE_MEMORY_MB`` (tests): pretend this much RAM (and VRAM) is free.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from node.config import NodeConfig

FAKE_FREE_ENV = "LOCOMESH_FAKE_FREE_MEMORY_MB"
GIB = 1 << 30
RUNTIME_RAM = 600 << 20  # python, torch, hivemind and p2pd before any model (measured: ~520 MiB on CPU)
CUDA_SLACK = 0.10  # of the GPU's memory: CUDA context, cuBLAS workspaces, the caching allocator's fragmentation


@dataclass
class Row:
    """One part of the estimate: what, where it lives (``RAM`` or ``VRAM``), bytes."""

    what: str
    where: str
    nbytes: int


@dataclass
class Estimate:
    """The parts of a node's memory, and what is free to hold them."""

    rows: list[Row]
    device: str  # cpu | cuda
    free_ram: int
    free_vram: int | None  # None without CUDA
    setting: str = ""  # the settings estimated, in words
    suggestions: list[str] = field(default_factory=list)

    def total(self, where: str) -> int:
        return sum(r.nbytes for r in self.rows if r.where == where)

    def short(self) -> list[str]:
        """Where the estimate exceeds what is free: e.g. ``["RAM (needs 12.3 GiB, 3.1 GiB free)"]``."""
        out = []
        for where, free in (("RAM", self.free_ram), ("VRAM", self.free_vram)):
            if free is not None and self.total(where) > free:
                out.append(f"{where} (needs {gib(self.total(where))}, {gib(free)} free)")
        return out

    @property
    def fits(self) -> bool:
        return not self.short()


def gib(n: int) -> str:
    """``41 MiB``, ``1.25 GiB``, ``146.4 GiB``."""
    if n < GIB:
        return f"{n / (1 << 20):.0f} MiB"
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.1f} GiB"


# ---- what is free ---------------------------------------------------------------------------------
def free_ram() -> int:
    """Bytes of RAM the kernel says can be allocated without swapping (``MemAvailable``)."""
    fake = os.environ.get(FAKE_FREE_ENV)
    if fake:
        return int(float(fake) * (1 << 20))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def free_vram() -> tuple[int, int]:
    """(free, total) bytes of the current CUDA device."""
    import torch

    free, total = torch.cuda.mem_get_info()
    fake = os.environ.get(FAKE_FREE_ENV)
    return (int(float(fake) * (1 << 20)) if fake else int(free)), int(total)


# ---- the model in force ---------------------------------------------------------------------------
def architecture(cfg: NodeConfig) -> Any:
    """The model config a node of ``cfg`` trains, read without loading data or weights."""
    from node.checkpoints.contents import is_hf_folder
    from node.data.shard_format import MANIFEST, is_shard_dir, read_manifest
    from swarm.models.presets import config_from_hf, preset, with_vocab

    if cfg.init_from is not None and is_hf_folder(cfg.init_from):
        model_cfg = config_from_hf(Path(cfg.init_from) / "config.json")
    elif cfg.model_config_file is not None:
        model_cfg = config_from_hf(cfg.model_config_file)
    else:
        vocab = 256
        if cfg.data is not None and is_shard_dir(cfg.data) and (Path(cfg.data) / MANIFEST).is_file():
            vocab = read_manifest(Path(cfg.data) / MANIFEST).vocab_size
        model_cfg = with_vocab(preset(cfg.model), vocab)
    return replace(model_cfg, context=cfg.context) if cfg.context is not None else model_cfg


@functools.lru_cache(maxsize=256)
def num_params(model_cfg: Any) -> int:
    """Parameters of a model config (built on the meta device once per config: the suggestions ask often)."""
    from swarm.models.presets import num_params as count

    return count(model_cfg)


def _params(model_cfg: Any, stage: tuple[int, int] | None = None) -> int:
    """Parameters of the whole model, or of stage ``(index, count)`` (its blocks, and the embeddings or head it holds)."""
    from swarm.stages import block_range

    total = num_params(model_cfg)
    if stage is None:
        return total
    one_block = (num_params(replace(model_cfg, n_layer=2)) - num_params(replace(model_cfg, n_layer=1)))
    outside = total - model_cfg.n_layer * one_block  # embeddings, final norm, head
    start, end = block_range(model_cfg.n_layer, *stage)
    ends = (stage[0] == 0) + (stage[0] == stage[1] - 1)
    return (end - start) * one_block + (outside if ends else 0)


def _per_block(model_cfg: Any) -> int:
    """Activation elements autograd keeps per token of one block (see the module docstring)."""
    if type(model_cfg).__name__ == "LlamaConfig":
        return 24 * model_cfg.d_model + 3 * model_cfg.d_ff
    return 20 * model_cfg.d_model


def activation_bytes(model_cfg: Any, rows: int, blocks: int, head: bool, checkpointing: bool, device: str,
                     backward: bool = True) -> int:
    """Peak activation memory of ``rows`` sequences through ``blocks`` blocks (and the head when ``head``)."""
    tokens = rows * model_cfg.context
    width = 4.0 if device == "cpu" else 2.5  # bf16 autocast on CUDA: bf16 matmul outputs, fp32 norms
    block = _per_block(model_cfg) * tokens * width
    if not backward:  # forward passes only (zo): the widest block and the logits at a time
        return int(2 * block + (2 * tokens * model_cfg.vocab_size * 4 if head else 0))
    kept = blocks * model_cfg.d_model * tokens * 4 + block if checkpointing else blocks * block
    transient = 2 * block  # a block's activation gradients in backward (and its recomputation when checkpointing)
    logits = 4 * tokens * model_cfg.vocab_size * 4 + 2 * model_cfg.d_model * tokens * 4 if head else 0
    return int(kept + transient + logits)


def _payload_bytes(codec: str, params: int) -> int:
    if codec == "none":
        return 4 * params
    return (2 if codec in ("fp16", "bf16") else 1) * params


# ---- the estimate ---------------------------------------------------------------------------------
def estimate(cfg: NodeConfig, model_cfg: Any, device: str, free: tuple[int, int | None], vram_total: int = 0) -> Estimate:
    """The memory a node of ``cfg`` needs for ``model_cfg`` on ``device`` (cpu | cuda), against ``free`` (RAM, VRAM)."""
    dev = "VRAM" if device == "cuda" else "RAM"
    outer = "RAM" if cfg.outer_device == "cpu" else dev
    rows: list[Row] = [Row("runtime (python, torch, hivemind, p2pd)", "RAM", RUNTIME_RAM)]
    stage: tuple[int, int] | None = None
    if cfg.stages > 1:
        if cfg.role == "trainer":
            return Estimate(rows, device, *free, setting=f"pipeline trainer of {_label(cfg)}")
        from swarm.stages import block_range

        count = cfg.stages
        index = cfg.stage if cfg.stage is not None else max(range(count), key=lambda i: _params(model_cfg, (i, count)))
        stage = (index, count)
    params = _params(model_cfg, stage)
    p4 = 4 * params
    if cfg.algorithm == "zo":
        rows += [Row("model parameters (fp32)", dev, p4), Row("perturbation direction z", dev, p4)]
        rows.append(Row(f"activations (forward only, batch {cfg.batch_size} × {model_cfg.context} tokens)", dev,
                        activation_bytes(model_cfg, cfg.batch_size, model_cfg.n_layer, True, False, device, backward=False)))
    else:
        rows += [Row("model parameters (fp32)", dev, p4), Row("gradients", dev, p4),
                 Row("inner optimizer (AdamW: 2 states)", dev, 2 * p4),
                 _step_temporaries(model_cfg, device, p4)]
        momentum = cfg.outer_hyper[1] > 0 or cfg.algorithm == "noloco"
        rows.append(Row(f"outer state (φ{' + momentum' if momentum else ''}, --outer-device {cfg.outer_device})", outer,
                        p4 * (2 if momentum else 1)))
        if stage is not None:
            blocks = block_range(model_cfg.n_layer, *stage)
            head = stage[0] == stage[1] - 1 or cfg.checkfree_plus
            act = activation_bytes(model_cfg, cfg.batch_size, blocks[1] - blocks[0], head, False, device)
            what = f"activations (stage {stage[0]}, microbatch {cfg.batch_size} × {model_cfg.context} tokens)"
        else:
            rows_per_pass = cfg.micro_batch_size or cfg.batch_size
            act = activation_bytes(model_cfg, rows_per_pass, model_cfg.n_layer, True, cfg.activation_checkpointing, device)
            what = (f"activations (micro-batch {rows_per_pass} × {model_cfg.context} tokens"
                    f"{', checkpointed' if cfg.activation_checkpointing else ''})")
        rows.append(Row(what, dev, act))
        if stage is None and cfg.scores_contributions and cfg.fragments == 1:
            rows.append(Row("contribution scoring model (fp32, --contribution-scores)", dev, p4))
        if cfg.feedback_decay() > 0:
            rows.append(Row(f"error-feedback residual ({cfg.codec})", "RAM", p4))
        rows.append(Row(f"round buffers (Δ, decoded mean, {cfg.codec} payload)", "RAM", 2 * p4 + _payload_bytes(cfg.codec, params)))
        if stage is None:
            # what a replica serves joiners is a copy of the round's φ (and momentum), made on a joiner's first request
            # and kept until the next round (gossip.state_server): counted, since a joiner may come any round; a
            # checkpoint copies φ and θ beside it
            held = p4 * (2 if momentum else 1)
            rows.append(Row(f"state served to joiners (φ{' + momentum' if momentum else ''}, copied when one asks)", "RAM", held))
            if cfg.checkpoint_dir is not None:
                rows.append(Row("a checkpoint's copies of φ and θ", "RAM", 2 * p4))
    if device == "cuda":
        rows.append(Row("CUDA context, workspaces, allocator slack", "VRAM", int(CUDA_SLACK * vram_total)))
    where = f"stage {stage[0]} of {stage[1]}" if stage else "whole model"
    setting = f"{_label(cfg)} ({params / 1e6:.1f} M parameters, {where}) on {device}"
    return Estimate(rows, device, *free, setting=setting)


def _step_temporaries(model_cfg: Any, device: str, p4: int) -> Row:
    """What the optimizer step and the gradient clipping allocate beside the state. On the CPU, AdamW's fused
    kernel steps in place and clipping scales the gradients in place: temporaries the size of one tensor
    at a time (counted as two of the largest). Measured: 115 MiB of growth beyond parameters, gradients,
    AdamW's states and activations for llama-150m at batch 1 (either AdamW kernel), where 2 × the parameters
    were counted before. On CUDA the 2 × the parameters stand: the estimate was checked against an H100's
    ``max_memory_allocated`` with them (module docstring)."""
    if device != "cuda":
        largest = max(model_cfg.vocab_size, 4 * model_cfg.d_model, getattr(model_cfg, "d_ff", 0) or 0) * model_cfg.d_model
        return Row("optimizer step temporaries (AdamW in place, clipping: the largest tensors)", "RAM", 2 * 4 * largest)
    return Row("optimizer step temporaries (AdamW, clipping)", "VRAM", 2 * p4)


def _label(cfg: NodeConfig) -> str:
    """The model as the user named it: the preset, or the file or folder its architecture comes from."""
    from node.checkpoints.contents import is_hf_folder

    if cfg.init_from is not None and is_hf_folder(cfg.init_from):
        return f"--init-from {cfg.init_from}"
    return f"--model-config {cfg.model_config_file}" if cfg.model_config_file is not None else cfg.model


def device_of(cfg: NodeConfig) -> str:
    """cpu or cuda: the device a node of ``cfg`` trains on."""
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_fit(cfg: NodeConfig) -> Estimate:
    """The estimate for ``cfg`` on this machine; when it does not fit, ``suggestions`` name settings that do."""
    device = device_of(cfg)
    vram_total = 0
    vram: int | None = None
    if device == "cuda":
        vram, vram_total = free_vram()
    free = (free_ram(), vram)
    model_cfg = architecture(cfg)
    est = estimate(cfg, model_cfg, device, free, vram_total)
    if not est.fits:
        est.suggestions = _suggest(cfg, model_cfg, device, free, vram_total)
    return est


def _fits(cfg: NodeConfig, model_cfg: Any, device: str, free: tuple[int, int | None], vram_total: int, **update: Any) -> bool:
    return estimate(cfg.model_copy(update=update), model_cfg, device, free, vram_total).fits


def _largest(ok: Any, upper: int) -> int:
    """The largest n in [1, upper] with ok(n) (ok is monotone: true up to some n), or 0."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _suggest(cfg: NodeConfig, model_cfg: Any, device: str, free: tuple[int, int | None], vram_total: int) -> list[str]:
    """The largest settings that fit, in the order a user would try them."""
    fits = lambda **u: _fits(cfg, model_cfg, device, free, vram_total, **u)  # noqa: E731
    out: list[str] = []
    if device == "cuda" and cfg.outer_device == "same" and fits(outer_device="cpu"):
        out.append("--outer-device cpu")
    if cfg.stages == 1 and cfg.algorithm != "zo":
        m = _largest(lambda n: fits(micro_batch_size=n), cfg.batch_size)
        if m:
            out.append(f"--micro-batch-size {m} (the largest that fits)")
        if not cfg.activation_checkpointing:
            m_ac = _largest(lambda n: fits(micro_batch_size=n, activation_checkpointing=True), cfg.batch_size)
            if m_ac > m:
                out.append(f"--activation-checkpointing{'' if m_ac == cfg.batch_size else f' --micro-batch-size {m_ac}'}")
    else:
        b = _largest(lambda n: fits(batch_size=n), cfg.batch_size)
        if b:
            out.append(f"--batch-size {b} (the largest that fits)")
    if cfg.init_from is None and cfg.model_config_file is None:
        smaller = _smaller_model(cfg, model_cfg, device, free, vram_total)
        if smaller:
            out.append(f"a smaller --model ({smaller} fits)")
    return out


def _smaller_model(cfg: NodeConfig, model_cfg: Any, device: str, free: tuple[int, int | None], vram_total: int) -> str | None:
    """The largest preset of the same family, with fewer parameters, that fits (at the smallest micro-batch
    with checkpointing when those apply)."""
    from swarm.models.presets import PRESETS, with_vocab

    own = num_params(model_cfg)
    update: dict[str, Any] = {}
    if cfg.stages == 1 and cfg.algorithm != "zo":
        update = {"micro_batch_size": 1, "activation_checkpointing": True}
    best: tuple[int, str] | None = None
    for name, preset in PRESETS.items():
        if type(preset) is not type(model_cfg) or cfg.stages > preset.n_layer:
            continue
        other = with_vocab(preset, model_cfg.vocab_size)
        other = replace(other, context=cfg.context) if cfg.context is not None else other
        n = num_params(other)
        if n < own and estimate(cfg.model_copy(update={**update, "model": name}), other, device, free, vram_total).fits:
            best = max(best or (n, name), (n, name))
    return best[1] if best else None


def refusal(est: Estimate) -> str:
    """The one line that refuses a node that does not fit."""
    hint = ("; try " + ", or ".join(est.suggestions)) if est.suggestions else "; no smaller setting fits: use a machine with more memory"
    return (f"not enough memory for {est.setting}: {' and '.join(est.short())}{hint} "
            f"(node join --dry-run shows the estimate)")


def as_dict(est: Estimate) -> dict[str, Any]:
    return {**dataclasses.asdict(est), "fits": est.fits, "ram": est.total("RAM"), "vram": est.total("VRAM")}


def render(est: Estimate) -> None:
    """The estimate as a small table (rich), its totals against free memory, and whether it fits."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"memory estimate: {est.setting}")
    table.add_column("part")
    table.add_column("where")
    table.add_column("size", justify="right")
    for r in est.rows:
        table.add_row(r.what, r.where, gib(r.nbytes))
    for where, free in (("RAM", est.free_ram), ("VRAM", est.free_vram)):
        if free is not None:
            table.add_row(f"[b]total {where}[/b]", where, f"[b]{gib(est.total(where))}[/b] of {gib(free)} free")
    Console(width=max(100, Console().width)).print(table)
    print("fits" if est.fits else refusal(est), flush=True)  # one line, never wrapped
