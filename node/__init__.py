"""locomesh node: the volunteer daemon, its CLI, local training, data, checkpoints and metrics."""

__version__ = "0.1.0"
