#!/usr/bin/env bash
# One entry point for the GPU machine: `bash benchmarks/device.sh STAGE...` from the repo root.
# Stages: tests (gpu-marked tests), kernels (kernel sweep, writes tuned configs), store (30B synthetic store),
# e2e (decode + prefill on it), limits. Logs and results go under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
STORE=/tmp/qwen3-30b
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    invariance) timeout 150 python -m pytest -q -m gpu -s tests/engine 2>&1 | tee "$OUT/gpu-invariance.log" | grep -v "^$" | tail -30 ;;
    tests) python -m pytest -q -m gpu -s tests 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^$" | tail -40 ;;
    kernels) timeout 400 python -m benchmarks.bench_kernels --quick --tune 2>&1 | tee "$OUT/kernels.log" | tail -12
             cp moestream/kernels/configs/expert_mlp.json "$OUT/" ;;
    kernels-full) python -m benchmarks.bench_kernels --tune 2>&1 | tee "$OUT/kernels.log" | tail -12
                  cp moestream/kernels/configs/expert_mlp.json "$OUT/" ;;
    store) [ -f $STORE/manifest.json ] || python -m benchmarks.synthetic $STORE --geometry qwen3-30b ;;
    kernels-decode) timeout 150 python -m benchmarks.bench_kernels --quick --tune --phases decode 2>&1 | tee "$OUT/kernels.log" | tail -8
                    cp moestream/kernels/configs/expert_mlp.json "$OUT/" ;;
    kernel-tests) timeout 150 python -m pytest -q -m gpu tests/kernels 2>&1 | tail -4 ;;
    decode) timeout 200 python -m benchmarks.bench_e2e $STORE --decode --profile 2>&1 | tee "$OUT/decode.log" | tail -30 ;;
    e2e) timeout 300 python -m benchmarks.bench_e2e $STORE --decode --prefill 2>&1 | tee "$OUT/e2e.log" | tail -20 ;;
    suite-stores) timeout 580 python -m benchmarks.suite stores --out "$OUT/suite" ;;
    suite-30b) timeout 580 python -m benchmarks.suite limits --out "$OUT/suite" && \
               timeout 580 python -m benchmarks.suite moestream --out "$OUT/suite" --store qwen3-30b=/tmp/suite-qwen3-30b \
               --modes q4 ;;
    suite-lowbit) python -m benchmarks.suite limits --out "$OUT/suite" && \
                  timeout 580 python -m benchmarks.suite moestream --out "$OUT/suite" \
                  --store qwen3-30b=/tmp/suite-qwen3-30b --modes low-bit ;;
    suite-next) timeout 580 python -m benchmarks.suite moestream --out "$OUT/suite" \
                --store qwen3.8-flash-next=/tmp/suite-qwen4 ;;
    suite-peers) timeout 580 python -m benchmarks.suite peers --out "$OUT/suite" ;;
    suite-report) python -m benchmarks.suite report --out "$OUT/suite" ;;
    limits) python -c "from benchmarks.common import limits; print(limits())" 2>&1 | tee "$OUT/limits.log" ;;
  esac
done
echo "=== done $(date +%T)"
