"""Probes: one question each, run by hand or by device.sh when a figure in docs/performance.md needs a why.

e2e              decode tok/s by mode, prefill copy/compute/host time per layer, optional Chrome timelines
host_cost        the host's work in one prefill layer's expert path, timed on the CPU
lowbit_accuracy  logit error and greedy agreement of Q3/Q2 (and mixed) experts against Q4
sass_counts      the expert kernels compiled for sm_90 without a GPU: registers, spills, loop instructions
step_kernels     a graphed decode step's kernels: launches a step, duration, the idle time after each
requests         the load, requests in a row, decode rate by answer length, the suite's headline rows; any checkout
"""
