"""The Qwen3-Next / Qwen3.5 family."""
