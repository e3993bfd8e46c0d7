#!/usr/bin/env bash
# One entry point for the GPU machine: `bash benchmarks/device.sh STAGE...` from the repo root.
# Every stage uses the suite's stores (/tmp/suite-*), built once per machine by `stores` (or `stores-bg`,
# which builds them in the background while later stages run; stages that need them wait). What a call leaves
# in /tmp serves the machine's later calls: the tuned tile configs and the suite's state. Logs and results go
# under $OUT, packed at the end into $OUT/results.tgz (a call returns at most 8 files). Name the commit sent with
# MOESTREAM_COMMIT=... (the machine's copy of .git can be stale).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
STORE=/tmp/suite-qwen3-30b
TUNED=/tmp/expert_mlp.tuned.json
STATE_DIR=/tmp/suite-state
TILES=moestream/kernels/configs/expert_mlp.json
[ -f "$TUNED" ] && cp "$TUNED" "$TILES"  # this checkout is the local one again
[ -n "${SUITE_STATE:-}" ] && mkdir -p $STATE_DIR && cp "$SUITE_STATE" $STATE_DIR/suite.json
[ -n "${MOESTREAM_COMMIT:-}" ] || echo "warning: MOESTREAM_COMMIT unset: rows record this copy's .git, which can be stale"
s12() { [ -f /tmp/s12/manifest.json ] || python -m benchmarks.synthetic /tmp/s12 --geometry qwen3-30b --layers 12; }  # 12 layers, 6 GB
keep_tiles() { cp "$TILES" "$OUT/" && cp "$TILES" $TUNED; }  # tuned tiles: in the results, and for later calls
wait_stores() { [ -f /tmp/stores.pid ] && while kill -0 "$(cat /tmp/stores.pid)" 2>/dev/null; do sleep 2; done; true; }
suite() {  # suite SECONDS STAGE ARGS...: state carried in $STATE_DIR between stages and calls
  local limit=$1; shift
  local state=(); [ -f $STATE_DIR/suite.json ] && state=(--state $STATE_DIR/suite.json)
  timeout "$limit" python -m benchmarks.suite "$@" --out "$OUT/suite" "${state[@]}" ${SUITE_ARGS:-}
  mkdir -p $STATE_DIR && cp "$OUT/suite/suite.json" $STATE_DIR/suite.json
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    stores) timeout 580 python -m benchmarks.suite stores --out "$OUT/suite" 2>&1 | tee "$OUT/stores.log" ;;
    stores-bg) setsid python -m benchmarks.suite stores --out "$OUT/suite" > /tmp/stores.log 2>&1 &  # outlives a call cut short
               echo $! > /tmp/stores.pid ;;
    invariance) timeout 150 python -m pytest -q -m gpu -s tests/engine 2>&1 | tee "$OUT/gpu-invariance.log" | grep -v "^$" | tail -30 ;;
    tests) python -m pytest -q -m gpu -s tests 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^$" | tail -40 ;;
    kernel-tests) timeout 400 python -m pytest -q -n 8 -m gpu ${KERNEL_TESTS:-tests/kernels tests/quant} 2>&1 | tee "$OUT/gpu-kernel-tests.log" | tail -4 ;;
    kernels) timeout 330 python -m benchmarks.bench_kernels --quick --tune 2>&1 | tee "$OUT/kernels.log" | tail -12
             keep_tiles ;;
    kernels-decode) timeout 300 python -m benchmarks.bench_kernels --quick --tune --phases decode \
                    --precisions "${KERNEL_PRECISIONS:-q4}" 2>&1 | tee "$OUT/kernels.log" | grep -v " rows .* us, " | tail -8
                    keep_tiles ;;
    kernels-prefill) timeout 300 python -m benchmarks.bench_kernels --quick --tune --phases prefill \
                     --precisions "${KERNEL_PRECISIONS:-q4}" 2>&1 | tee "$OUT/kernels.log" | grep -v "resident .* ms, ring batch" | tail -10
                     keep_tiles ;;
    kernels-host) timeout 240 python -m benchmarks.bench_kernels --quick --host --tune --precisions q4,q3,q2 2>&1 \
                  | tee "$OUT/kernels-host.log" | grep -v " rows .* us, " | tail -14  # tunes Q3/Q2 decode
                  keep_tiles ;;
    decode) wait_stores; timeout 200 python -m benchmarks.bench_e2e $STORE --decode --profile 2>&1 | tee "$OUT/decode.log" | tail -30 ;;
    e2e) wait_stores; timeout 300 python -m benchmarks.bench_e2e $STORE --decode --prefill 2>&1 | tee "$OUT/e2e.log" | tail -20 ;;
    overlap) wait_stores; timeout 200 python -m benchmarks.bench_e2e $STORE --prefill --fracs 0.25 --lengths 4096 \
             --host-gb 24 --warm 2>&1 | tee "$OUT/overlap.log" | tail -8 ;;
    overlap-trace) s12
             timeout 240 python -m benchmarks.bench_e2e /tmp/s12 --prefill --fracs 0.25,1.0 --lengths 4096 --host-gb 8 \
             --warm --trace --ring-groups 8,16 --ring-lookahead off,on 2>&1 | tee "$OUT/overlap-trace.log" | tail -12 ;;
    decode-s12) s12; timeout 150 python -m benchmarks.bench_e2e /tmp/s12 --decode --profile 2>&1 | tee "$OUT/decode-s12.log" | tail -40 ;;
    decode-ab) s12  # graphed decode with each opt-in kernel set, against the defaults
               for opt in "" MOESTREAM_DENSE=cublas MOESTREAM_PDL=all "MOESTREAM_DENSE=cublas MOESTREAM_PDL=all"; do
                 echo "--- ${opt:-defaults}"
                 env $opt timeout 100 python -m benchmarks.bench_e2e /tmp/s12 --decode --decode-modes graph 2>&1 | grep "'mode'"
               done | tee "$OUT/decode-ab.log" ;;
    mma-next) timeout 200 python -m pytest -q -n 8 -m gpu tests/kernels/test_expert_mma.py 2>&1 | tee "$OUT/gpu-mma-tests.log" | tail -2
              timeout 240 python -m benchmarks.decode_mma --trigger 2>&1 | tee "$OUT/decode-mma-trigger.log" | tail -16
              timeout 90 python -m benchmarks.decode_mma --trigger --trace 2>&1 | tee "$OUT/trace-trigger.log" | tail -60 ;;
    phases) timeout 200 python -m benchmarks.decode_phases 2>&1 | tee "$OUT/phases.log" | tail -16
            timeout 100 python -m benchmarks.decode_phases --trace 2>&1 | tee "$OUT/phases-trace.log" | tail -20 ;;
    first-prompt) timeout 120 python -m benchmarks.first_prompt 2>&1 | tee "$OUT/first-prompt.log" ;;
    limits) wait_stores; suite 120 limits ;;
    suite-30b) wait_stores; suite "${SUITE_SECONDS:-580}" moestream --store qwen3-30b=$STORE --modes q4 ;;
    suite-lowbit) wait_stores; suite "${SUITE_SECONDS:-580}" moestream --store qwen3-30b=$STORE --modes low-bit ;;
    suite-next) wait_stores; suite "${SUITE_SECONDS:-580}" moestream --store qwen3.8-flash-next=/tmp/suite-qwen4 ;;
    suite-peers) wait_stores; suite "${PEERS_SECONDS:-${SUITE_SECONDS:-580}}" peers ;;
  esac
done
wait_stores
rm -rf /tmp/s12  # the suite's stores leave room on the 64 GB disk for the low-bit variants only
[ -f /tmp/stores.log ] && cp /tmp/stores.log "$OUT/"
echo "=== done $(date +%T)"
tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
