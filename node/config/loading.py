"""Reading a node's configuration: defaults < ``--config`` TOML file < ``LOCOMESH_*`` env < flags, and the swarm key."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from node.config.node_config import ConfigError, NodeConfig

def read_swarm_key(path: Path) -> bytes:
    """The secret of a private swarm: a file of at least 16 bytes (hex text is decoded)."""
    try:
        raw = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read --swarm-key {path}: {e.strerror}") from None
    try:
        key = bytes.fromhex(raw.decode())
    except (UnicodeDecodeError, ValueError):
        key = raw
    if len(key) < 16:
        raise ConfigError(
            f"--swarm-key {path} holds {len(key)} bytes; use at least 16, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))' > swarm.key"
        )
    return key


def read_config_file(path: Path) -> dict[str, Any]:
    """Options from a TOML file (keys as flag names, with - or _)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    table = raw.get("node", raw)
    options = {k.replace("-", "_"): v for k, v in table.items()}
    return {next((f for f, flag in FLAG_OF.items() if flag == k), k): v for k, v in options.items()}


def load_config(flags: dict[str, Any], config_file: Path | None = None) -> NodeConfig:
    """Merge defaults < config file < flags/env (``flags`` holds only values that were set)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(read_config_file(config_file))
    merged.update({k: v for k, v in flags.items() if v is not None and v != [] and v != ()})
    try:
        return NodeConfig(**merged)
    except ValidationError as e:
        problems = "; ".join(
            (f"--{FLAG_OF.get(str(err['loc'][0]), str(err['loc'][0])).replace('_', '-')}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def _declared_flags() -> dict[str, str]:
    extra = {name: (f.json_schema_extra or {}) for name, f in NodeConfig.model_fields.items()}
    return {name: e["flag"] for name, e in extra.items() if isinstance(e, dict) and "flag" in e}


FLAG_OF = _declared_flags()  # fields whose flag differs from their name (pydantic reserves model_config)
