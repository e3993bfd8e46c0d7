"""Offline packing: a Hugging Face or MLX checkpoint folder -> a moestream store (see experts/format.py)."""
