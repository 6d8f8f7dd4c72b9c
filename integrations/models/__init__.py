"""Models shipped with the integrations (not adapters): the Qwen2.5-VL classifier."""
