"""The start of a kernel launched as a dependent (moestream/kernels/launch.py)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """Wait for the kernel before (nothing it wrote is read, and no memory it may still read is written, before
    this), then let the next kernel's blocks launch: what that one reads before its own wait (the down GEMV's
    weights and entries) was then written two kernels back or earlier."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
