"""Model FLOPs utilisation (MFU) and peak memory of the training device.

MFU = model FLOPs per token × tokens per second ÷ the device's peak, with the model's FLOPs per token
from :func:`swarm.models.presets.model_flops_per_token` (6·N + 12·n_layer·d_model·context, PaLM appendix B):
recomputation under activation checkpointing does not count (that would be hardware FLOPs
utilisation). The peak is the dense (not 2:4-sparse) bf16 tensor-core rate with fp32 accumulation
from NVIDIA's datasheets (fp16 for V100 and T4, which have no bf16), matched by the GPU's name;
``--peak-tflops`` overrides it. MFU is None on the CPU and on a GPU missing from the table.
"""

from __future__ import annotations

import math
import re
import resource
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from node.runtime.metrics import NodeMetrics
    from node.runtime.summary import Summary

# (name pattern, dense bf16 TFLOPS); first match wins, so more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("h200 nvl", 835.0),
    ("gh200", 989.4),
    ("h200", 989.4),
    ("a100", 312.0),  # 40 GB and 80 GB, SXM and PCIe
    ("a10g", 125.0),  # A10 datasheet; AWS's A10G often measures lower: set --peak-tflops to taste
    ("a10", 125.0),
    ("l40s", 362.0),
    ("l40", 181.0),
    ("l4", 121.0),
    ("rtx 4090", 165.2),  # GeForce: fp32 accumulation runs at half the fp16-accumulate rate
    ("rtx 3090", 71.0),
    ("v100 pcie", 112.0),  # fp16
    ("v100", 125.0),  # SXM2, fp16
    ("t4", 65.0),  # fp16
)


def lookup_peak_tflops(device_name: str) -> float | None:
    """The table's peak for a ``torch.cuda.get_device_name()``, or None when no entry matches."""
    name = re.sub(r"[-_]", " ", device_name.lower())
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(rf"\b{re.escape(pattern)}\b", name):
            return tflops
    return None


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of ``device``: ``override_tflops`` when given (any device), else the table's entry
    for a CUDA device's name; None on the CPU and for unknown GPUs."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    tflops = lookup_peak_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def flops_per_token(model_cfg: object) -> float:
    """Training FLOPs per token of a model config (forward and backward)."""
    from swarm.models.presets import model_flops_per_token

    return model_flops_per_token(model_cfg)  # type: ignore[arg-type]


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None without a peak or before any throughput is known)."""
    if peak is None or peak <= 0 or not tokens_per_s > 0:
        return None
    return flops_per_token * tokens_per_s / peak


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far, MiB: tensors allocated on a CUDA device, else this process's peak RSS."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def record_throughput(summary: "Summary", metrics: "NodeMetrics", device: torch.device, flops_per_token: float,
                      peak: float | None, exported: float | None = None, summarized: float | None = None) -> None:
    """Export the MFU of ``exported`` tokens/s (``locomesh_mfu``), put ``summarized`` tokens/s and its MFU in
    the summary (each when given), and the device's peak memory."""
    if exported is not None:
        value = mfu(flops_per_token, exported, peak)
        metrics.mfu.set(math.nan if value is None else value)
    if summarized is not None:
        summary.tokens_per_s, summary.mfu = summarized, mfu(flops_per_token, summarized, peak)
    summary.peak_mem_mb = round(peak_memory_mb(device), 1)
