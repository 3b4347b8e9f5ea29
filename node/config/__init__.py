"""A node's settings: declared once (``defaults.option``), validated as one model (``NodeConfig``), read from
flags, environment and a TOML file (``loading``). Import from here: ``from node.config import NodeConfig``."""

from node.config.defaults import (
    AUTO_STEPS_MAX_FACTOR, AVG, BY_REPLICAS, DEFAULT_INNER_STEPS, ENV_PREFIX, LOSSLESS_CODECS, LOSSY_DILOCO_OUTER,
    LOSSY_FEEDBACK_DECAY, LOSSY_WARMUP_ROUNDS, OPS, OUTER_DEFAULTS, PIPE, SEED_DILOCO_OUTER, SPARSE_CODEC, SWARM, TRAIN, option,
    steps_for_replicas,
)
from node.config.loading import FLAG_OF, load_config, read_config_file, read_swarm_key
from node.config.node_config import ConfigError, NodeConfig

__all__ = [
    "AUTO_STEPS_MAX_FACTOR", "AVG", "BY_REPLICAS", "DEFAULT_INNER_STEPS", "ENV_PREFIX", "LOSSLESS_CODECS", "LOSSY_DILOCO_OUTER",
    "LOSSY_FEEDBACK_DECAY", "LOSSY_WARMUP_ROUNDS", "OPS", "OUTER_DEFAULTS", "PIPE", "SEED_DILOCO_OUTER", "SPARSE_CODEC",
    "SWARM", "TRAIN", "option", "FLAG_OF", "load_config", "read_config_file", "read_swarm_key", "ConfigError", "NodeConfig",
    "steps_for_replicas",
]
