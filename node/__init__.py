"""locomesh node: the volunteer daemon, its CLI, local training, data, checkpoints and metrics."""

from protocol.version import LOCOMESH_VERSION as __version__  # noqa: F401 (pyproject.toml says the same)
