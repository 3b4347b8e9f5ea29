"""Checkpoint files: atomic writes, the folder lock and the Hugging Face export."""
