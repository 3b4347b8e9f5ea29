"""What a checkpoint file or a model folder holds, read without building a model: which preset a
locomesh checkpoint trained, and whether a folder is a Hugging Face export."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def is_hf_folder(path: Path | None) -> bool:
    """True when ``path`` is a Hugging Face model folder (``config.json`` beside safetensors weights)."""
    return path is not None and Path(path).is_dir() and (Path(path) / "config.json").is_file()


def checkpoint_model(path: Path) -> str | None:
    """The ``--model`` preset a locomesh checkpoint (``checkpoint.pt`` or its folder) holds: the one its
    node ran with when that preset's architecture matches the checkpoint's (vocabulary and context
    aside), else the first preset that does; None for a Hugging Face folder, an unreadable file or a
    custom architecture. Lets ``--init-from CHECKPOINT`` leave out ``--model``."""
    from node.checkpoints.checkpoint import CHECKPOINT_NAME, load
    from swarm.models.presets import PRESETS

    path = Path(path)
    file = path / CHECKPOINT_NAME if path.is_dir() else path
    if is_hf_folder(path) or not file.is_file():
        return None
    try:
        state = load(file)
    except Exception:  # load_init_weights says what is wrong with it
        return None
    held = state.get("model_config")
    if not isinstance(held, dict):
        return None
    config = state.get("config") if isinstance(state.get("config"), dict) else {}

    def shape(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in ("vocab_size", "context")}

    recorded = [config["model"]] if config.get("model") in PRESETS else []
    return next((name for name in recorded + list(PRESETS) if shape(PRESETS[name].to_dict()) == shape(held)), None)
