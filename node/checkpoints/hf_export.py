"""Hugging Face interop: ``node export`` writes a locomesh Llama checkpoint (or, with
:func:`write_hf_folder`, a live pipeline's stages: ``node.ops.pipeline_export``) as a ``LlamaForCausalLM``
folder, and :func:`load_hf_folder` reads such a folder back (``node join --init-from DIR``).

The folder holds ``config.json``, ``model.safetensors`` (fp32, Hugging Face tensor names),
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (the checkpoint's tokenizer, or
for a model trained on plain text a byte-level one whose ids are the UTF-8 bytes): ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` load it without custom code. Only ``safetensors`` and
``tokenizers`` are used here; ``transformers`` is never imported.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from node.checkpoints.checkpoint import CHECKPOINT_NAME, load
from node.errors import UserError
from swarm.models.llama import Llama, LlamaConfig, hf_name
from swarm.models.presets import GPTConfig, config_from_dict, config_from_hf

logger = logging.getLogger(__name__)
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")  # first found is the eos token
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]")  # none found: bos = eos (GPT-2's convention)
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some older exports saved


def _layout(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of each parameter, in locomesh's ``parameters()`` order."""
    with torch.device("meta"):
        model = Llama(cfg)
    return [(hf_name(n), tuple(p.shape)) for n, p in model.named_parameters()]


# ---- export ----------------------------------------------------------------------------------------------
def export_checkpoint(checkpoint: Path, out: Path, weights: str = "phi") -> Path:
    """Write the Hugging Face folder ``out`` (atomically: nothing there until it is complete) from a
    locomesh checkpoint (``checkpoint.pt`` or its folder); ``weights`` is ``phi`` (the swarm's agreed
    weights) or ``theta`` (the node's last local ones). Raises :class:`UserError`."""
    checkpoint, out = Path(checkpoint).expanduser(), Path(out).expanduser()
    if weights not in ("phi", "theta"):
        raise UserError(f"--weights {weights!r}: use phi (the swarm's agreed weights) or theta (the node's last local weights)")
    file = checkpoint / CHECKPOINT_NAME if checkpoint.is_dir() else checkpoint
    try:
        state = load(file)
    except FileNotFoundError:
        raise UserError(f"--checkpoint {checkpoint}: no checkpoint at {file}; give the checkpoint.pt a node wrote in its --checkpoint-dir") from None
    except ValueError as e:
        raise UserError(f"--checkpoint {checkpoint}: {e}") from None
    cfg = _llama_config(state, file)
    tensors = _named_tensors(state, weights, cfg, file)
    tokenizer = state.get("tokenizer")
    if isinstance(tokenizer, bytes):
        tokenizer = tokenizer.decode("utf-8")
    write_hf_folder(out, cfg, tensors, tokenizer, {"round": str(state.get("round", "")), "weights": weights}, f"--checkpoint {file}")
    logger.info("exported %s (%s, round %s) to %s", file, weights, state.get("round"), out)
    return out


def write_hf_folder(out: Path, cfg: LlamaConfig, tensors: dict[str, torch.Tensor], tokenizer: str | None,
                    provenance: dict[str, str], source: str) -> Path:
    """Write the Hugging Face folder ``out`` atomically (nothing there until it is complete) from fp32 tensors by
    Hugging Face name and a tokenizer.json text (None for a byte-level model: a byte-level one is written);
    ``source`` names where the weights came from in error messages. Raises :class:`UserError`."""
    out = Path(out).expanduser()
    if not tokenizer and cfg.vocab_size == 256:  # trained on plain text: its tokens are the UTF-8 bytes
        from node.data.tokenizer import byte_level_tokenizer_json

        tokenizer = byte_level_tokenizer_json()
    special = _special_tokens(tokenizer, cfg, source) if tokenizer else {}
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder; choose a new folder or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_folder(tmp, cfg, tensors, tokenizer, special, provenance)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _llama_config(state: dict[str, Any], file: Path) -> LlamaConfig:
    if not isinstance(state.get("model_config"), dict):
        raise UserError(f"--checkpoint {file} holds no model_config: not a checkpoint a locomesh node wrote")
    settings = state.get("settings") if isinstance(state.get("settings"), dict) else {}
    config = state.get("config") if isinstance(state.get("config"), dict) else {}
    if "stage" in state or max(int(settings.get("stages", 1) or 1), int(config.get("stages", 1) or 1)) > 1:
        raise UserError(f"--checkpoint {file} is a pipeline stage's (--stages > 1) and holds only part of the model; "
                        "export the checkpoint of a whole-model node (--stages 1), or a live pipeline's stages with "
                        "node export --run-id RUN --initial-peers ADDR")
    try:
        cfg = config_from_dict(state["model_config"])
    except (ValueError, TypeError) as e:
        raise UserError(f"--checkpoint {file}: its model_config is not readable ({e})") from None
    if isinstance(cfg, GPTConfig):
        raise UserError(f"--checkpoint {file} holds a byte-level GPT, which has no Hugging Face Llama equivalent; "
                        "only checkpoints of --model llama-* runs can be exported")
    return cfg


def _named_tensors(state: dict[str, Any], weights: str, cfg: LlamaConfig, file: Path) -> dict[str, torch.Tensor]:
    tensors = state.get(weights)
    if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise UserError(f"--checkpoint {file} holds no {weights} weights; try --weights {'theta' if weights == 'phi' else 'phi'}")
    layout = _layout(cfg)
    if len(tensors) != len(layout):
        raise UserError(f"--checkpoint {file}: {weights} holds {len(tensors)} tensors, its model_config needs {len(layout)}; "
                        "is it a pipeline stage's checkpoint? export a whole-model node's")
    out = {}
    for (name, shape), t in zip(layout, tensors):
        if tuple(t.shape) != shape:
            raise UserError(f"--checkpoint {file}: {name} has shape {list(t.shape)}, its model_config needs {list(shape)}")
        out[name] = t.detach().to(torch.float32).contiguous()
    return out


def _special_tokens(tokenizer_json: str, cfg: LlamaConfig, source: str) -> dict[str, Any]:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise UserError(f"{source}: its tokenizer is not readable ({' '.join(str(e).split())})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise UserError(f"{source}: its tokenizer has {size} tokens but the model only {cfg.vocab_size}")
    eos = next((t for t in EOS_NAMES if tok.token_to_id(t) is not None), None)
    bos = next((t for t in BOS_NAMES if tok.token_to_id(t) is not None), eos)
    return {"bos_token": bos, "eos_token": eos,
            "bos_token_id": tok.token_to_id(bos) if bos else None, "eos_token_id": tok.token_to_id(eos) if eos else None}


def hf_config(cfg: LlamaConfig, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a :class:`LlamaConfig` (read by transformers 4.x and 5.x alike)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.context,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None,
        "torch_dtype": "float32", "dtype": "float32",
    }


def _write_folder(folder: Path, cfg: LlamaConfig, tensors: dict[str, torch.Tensor], tokenizer: str | None,
                  special: dict[str, Any], provenance: dict[str, str]) -> None:
    from safetensors.torch import save_file

    bos_id, eos_id = special.get("bos_token_id"), special.get("eos_token_id")
    _write_json(folder / "config.json", hf_config(cfg, bos_id, eos_id))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", **{f"locomesh_{k}": v for k, v in provenance.items()}})
    _fsync(folder / "model.safetensors")
    _write_json(folder / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})  # no max_length: it would clash with a caller's max_new_tokens
    if tokenizer:
        (folder / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
        _fsync(folder / "tokenizer.json")
        _write_json(folder / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special.get("bos_token"),
            "eos_token": special.get("eos_token"), "model_max_length": cfg.context,
            "clean_up_tokenization_spaces": False})
    _fsync_dir(folder)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems refuse fsync on folders
        pass


# ---- import ----------------------------------------------------------------------------------------------
def load_hf_folder(directory: Path) -> tuple[LlamaConfig, list[torch.Tensor], str | None]:
    """(config, fp32 tensors in locomesh ``parameters()`` order, tokenizer.json text or None) of a Hugging Face
    Llama folder: ``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``.

    The config's ``context`` is its ``max_position_embeddings``; replace it to train on shorter sequences (the
    weights do not depend on it). Raises :class:`UserError` naming the file or tensor at fault.
    """
    from safetensors import safe_open

    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise UserError(f"{directory} is not a folder; give a Hugging Face model folder (config.json + model.safetensors)")
    try:
        cfg = config_from_hf(directory / "config.json")
    except ValueError as e:
        raise UserError(str(e)) from None
    files = _weight_files(directory)
    layout = dict(_layout(cfg))
    found: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in names if names is not None else list(f.keys()):
                    if name in layout:
                        found[name] = f.get_tensor(name)
                    elif (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith(IGNORED_SUFFIXES):
                        continue
                    else:
                        raise UserError(f"{file}: unexpected tensor {name}; it does not fit a plain Llama of this config.json")
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{file} is not a readable safetensors file ({' '.join(str(e).split())[:160]})") from None
    tensors = []
    for name, shape in layout.items():
        if name not in found:
            raise UserError(f"{directory}: tensor {name} is missing from the weights")
        if tuple(found[name].shape) != shape:
            raise UserError(f"{directory}: tensor {name} has shape {list(found[name].shape)}, config.json needs {list(shape)}")
        tensors.append(found[name].to(torch.float32))
    tok_file = directory / "tokenizer.json"
    return cfg, tensors, tok_file.read_text(encoding="utf-8") if tok_file.is_file() else None


def _weight_files(directory: Path) -> dict[Path, list[str] | None]:
    """safetensors files and the tensor names to read from each (None: all)."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return {single: None}
    if not index.is_file():
        raise UserError(f"{directory} holds neither model.safetensors nor model.safetensors.index.json; "
                        "give a Hugging Face folder saved with safetensors")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{index} is not a safetensors index ({e})") from None
    files: dict[Path, list[str] | None] = {}
    for name, shard in weight_map.items():
        path = directory / shard
        if Path(shard).is_absolute() or ".." in Path(shard).parts or not path.is_file():
            raise UserError(f"{index}: shard {shard!r} of tensor {name} is not a file in {directory}")
        files.setdefault(path, []).append(name)  # type: ignore[union-attr]
    return files
