"""Hot ops as triplets: a torch reference (reference.py, also the CPU path and the test oracle), a Triton
version (triton/), and a dispatcher (ops.py) that picks one by device and `MOESTREAM_KERNELS`."""
