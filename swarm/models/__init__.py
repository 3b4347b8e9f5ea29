"""The models: presets, a GPT and a Llama, built from plain torch (no locomesh imports)."""
