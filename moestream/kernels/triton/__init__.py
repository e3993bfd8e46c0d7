"""@triton.jit kernels only; launching and shapes live in moestream/kernels/*.py."""
