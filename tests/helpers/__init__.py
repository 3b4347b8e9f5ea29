"""Shared test helpers: launching real nodes, the in-memory transport, CLI batch runners, fuzzing."""
