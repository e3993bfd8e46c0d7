"""Quantization: MLX affine formats, pack-time quantizers and the torch reference dequantizers."""
