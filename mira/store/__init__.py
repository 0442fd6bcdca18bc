"""The expert store: quantization, blob layout, conversion from checkpoints, and loading."""
