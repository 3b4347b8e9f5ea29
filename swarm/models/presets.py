"""The model registry: named presets of both families (the byte-level :class:`GPT` of ``swarm.models.gpt`` and the
:class:`Llama` of ``swarm.models.llama``), and one way to build, describe and size any of them.

A model config is a frozen dataclass with ``to_dict()``; :func:`config_from_dict` reads one back (a dict
without ``"family"`` is a GPT: checkpoints written before Llama existed), :func:`config_from_hf` reads a
Hugging Face ``config.json`` of a Llama, :func:`with_vocab` sizes the embeddings for a tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from swarm.models.gpt import GPT, Block, CausalSelfAttention, GPTConfig
from swarm.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "ModelConfig", "PRESETS", "preset", "build_model",
           "config_from_dict", "config_from_hf", "with_vocab", "num_params", "model_flops_per_token",
           "Block", "CausalSelfAttention"]

ModelConfig = Union[GPTConfig, LlamaConfig]
FAMILIES: dict[str, tuple[type, type[nn.Module]]] = {"gpt": (GPTConfig, GPT), "llama": (LlamaConfig, Llama)}

PRESETS: dict[str, ModelConfig] = {
    "nano": GPTConfig(n_layer=2, n_head=2, d_model=64, context=64),  # tests: ~0.1 M params
    "micro": GPTConfig(n_layer=4, n_head=2, d_model=64, context=64),  # pipeline tests (4 blocks): ~0.2 M params
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, context=128),  # ~0.8 M params, CPU demo
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, context=256),  # ~10.7 M params
    "medium": GPTConfig(n_layer=12, n_head=12, d_model=768, context=512),  # ~85 M params, GPU
    # Llama family (vocab sizes are defaults: with_vocab() takes the tokenizer's)
    "llama-tiny": LlamaConfig(vocab_size=4096, context=128, n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=384),  # 1.3 M, CPU tests
    "llama-20m": LlamaConfig(vocab_size=8192, context=256, n_layer=12, n_head=6, n_kv_head=2, d_model=384, d_ff=1024),  # 22.0 M
    "llama-150m": LlamaConfig(vocab_size=32000, context=1024, n_layer=20, n_head=12, n_kv_head=4, d_model=768, d_ff=2048),  # 150.4 M
    # Llama-3.2-1B's blocks (16 × d 2048, 32 heads, 8 kv heads, SwiGLU 8192, θ 500000), untied head at vocab 32000: 1.10 B
    "llama-1b": LlamaConfig(vocab_size=32000, context=2048, n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192,
                            rope_theta=500000.0, tie_embeddings=False),
}


def preset(name: str) -> ModelConfig:
    """The config of a named preset; unknown names raise ``ValueError`` listing the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of a config, freshly initialised from torch's current RNG (on torch's default device)."""
    for config_type, model_type in FAMILIES.values():
        if type(cfg) is config_type:
            return model_type(cfg)
    raise TypeError(f"not a model config: {type(cfg).__name__}")


def _coerce(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """Check the values' types against the dataclass fields (ints stay ints, floats accept ints)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    out: dict[str, Any] = {}
    for name, value in d.items():
        kind = str(fields[name].type)
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str)}.get(kind, True)
        if not ok:
            raise ValueError(f"model config field {name} must be {kind}, got {value!r}")
        out[name] = float(value) if kind == "float" else value
    return out


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """The config a ``to_dict()`` wrote (a checkpoint's ``model_config``, a ``--model-config`` file).
    Missing fields take the family's defaults; unknown fields or wrong types raise ``ValueError``."""
    if not isinstance(d, dict):
        raise ValueError(f"a model config is a JSON object of fields, got {type(d).__name__}")
    d = dict(d)
    family = d.pop("family", "gpt")  # checkpoints from before the Llama family carry no marker
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    cls = FAMILIES[family][0]
    if family == "llama":
        d["family"] = family
    return cls(**_coerce(cls, d))


def with_vocab(cfg: ModelConfig, vocab_size: int) -> ModelConfig:
    """``cfg`` with its embeddings (and head) sized for a tokenizer of ``vocab_size`` tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
    return dataclasses.replace(cfg, vocab_size=int(vocab_size))


def num_params(cfg: ModelConfig) -> int:
    """Parameters of the model (a tied embedding counted once), from the config's shapes: nothing is built
    (tests/unit/test_llama.py checks it against a model built on the meta device)."""
    if not isinstance(cfg, (GPTConfig, LlamaConfig)):
        raise TypeError(f"not a model config: {type(cfg).__name__}")
    return cfg.param_count()


def model_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward) for MFU: 6·N + 12·n_layer·d_model·context.

    N counts the parameters that multiply: a tied embedding once (as the head), an untied input
    embedding and learned positions not at all (they are lookups). The attention term is the QKᵀ and
    AV products over the full context (PaLM, Chowdhery et al. 2022, appendix B; no causal discount).
    """
    n = num_params(cfg)
    if isinstance(cfg, GPTConfig):
        n -= cfg.context * cfg.d_model  # pos_emb
    elif not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.d_model  # tok_emb
    return float(6 * n + 12 * cfg.n_layer * cfg.d_model * cfg.context)


# ---- Hugging Face config.json ----------------------------------------------------------------------------
def config_from_hf(path: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama ``config.json`` (or the folder holding it).

    Refused with a ``ValueError`` naming the field: another ``model_type``, ``rope_scaling`` or a
    ``rope_parameters`` type other than default, attention or MLP biases, an activation other than
    SiLU, a ``head_dim`` other than hidden_size / num_attention_heads, attention dropout.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"no config.json at {file}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not a readable JSON config ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file} is not a JSON object")

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{file}: {field} {hf.get(field)!r} is not supported ({why})")

    if hf.get("model_type", "llama") != "llama":
        raise refuse("model_type", "only llama configs can be read")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if k not in hf]
    if missing:
        raise ValueError(f"{file} lacks {', '.join(missing)}: not a Llama config.json")
    theta = hf.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "default"):
        raise refuse("rope_scaling", "only plain rotary embeddings are implemented")
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("rope_type", params.get("type", "default")) != "default" \
                or set(params) - {"rope_type", "type", "rope_theta"}:
            raise refuse("rope_parameters", "only rope_type default with rope_theta is implemented")
        theta = params.get("rope_theta", theta)
    if hf.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
        raise refuse("partial_rotary_factor", "rotary embeddings cover the whole head here")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise refuse(field, "these layers have no biases here")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise refuse("hidden_act", "the MLP is SwiGLU")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise refuse("attention_dropout", "the model has no dropout")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // max(heads, 1)):
        raise refuse("head_dim", "it must be hidden_size / num_attention_heads")
    fields = {"vocab_size": hf["vocab_size"], "context": hf.get("max_position_embeddings", 2048),
              "n_layer": hf["num_hidden_layers"], "n_head": heads, "d_model": hf["hidden_size"],
              "n_kv_head": hf.get("num_key_value_heads") or heads, "d_ff": hf["intermediate_size"],
              "rope_theta": theta, "norm_eps": hf.get("rms_norm_eps", 1e-6),
              "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "family": "llama"}
    try:
        return LlamaConfig(**_coerce(LlamaConfig, fields))
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
