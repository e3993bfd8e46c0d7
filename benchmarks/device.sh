#!/usr/bin/env bash
# One entry point for the GPU machine: `bash benchmarks/device.sh STAGE...` from the repo root.
# Stores, the suite's state and logs of background builds live in $WORK (MOESTREAM_BENCH_DIR, default
# /tmp/moestream-bench), built once a machine by `stores` (or `stores-bg`, in the background while later stages run;
# stages that need the stores wait). Results go under $OUT, packed at the end into $OUT/results.tgz. Tuned tiles
# stay in $OUT/kernels/expert_mlp.json: commit them by hand. Name the commit sent with MOESTREAM_COMMIT=...
set -uo pipefail
SITE="${PYTHONPATH:-}"  # wheels carried to the machine (/tmp/site), kept behind each tree
if [ -z "$SITE" ] && ls .whl/*.whl > /dev/null 2>&1; then  # carried in .whl (fla-core: the DeltaNet models' tests)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}" PYTHONUNBUFFERED=1
export MOESTREAM_BENCH_DIR="${MOESTREAM_BENCH_DIR:-/tmp/moestream-bench}"
WORK="$MOESTREAM_BENCH_DIR"
OUT="${OUT:-$WORK/out}"
mkdir -p "$WORK" "$OUT"
STORE="$WORK/qwen3-30b"
STATE="$WORK/state/suite.json"
[ -n "${SUITE_STATE:-}" ] && mkdir -p "$(dirname "$STATE")" && cp "$SUITE_STATE" "$STATE"
[ -n "${MOESTREAM_COMMIT:-}" ] || echo "warning: MOESTREAM_COMMIT unset: rows record this copy's .git, which can be stale"
q30s() {  # the 48-layer 30B geometry, its Q4 records holes in a sparse file (no record bytes written)
  [ -f "$WORK/q30s/manifest.json" ] || python -c "from benchmarks.synthetic import build; \
build('$WORK/q30s', 'qwen3-30b', sparse=('q4',))" > "$OUT/q30s.log" 2>&1
}
profile() {  # profile STORE LOG ARGS...: a resident 4096 prefill by kernel, and where its GPU waits
  timeout 200 python -m benchmarks.probes.resident "$1" --profile 4096 --trace 4096 "${@:3}" 2>&1 | tee "$OUT/$2" \
    | grep -v Warning | head -45
}
fn12() {  # a 12-layer Flash-Next slice, Q4 records holes in a sparse file, Q2 beside them
  [ -f "$WORK/fn12/manifest.json" ] || python -m benchmarks.synthetic "$WORK/fn12" --geometry qwen3.8-flash-next \
    --layers 12 --ngram-rows 1000000 --precisions q4,q2 --sparse q4 > "$OUT/fn12.log" 2>&1
}
wait_stores() { [ -f "$WORK/stores.pid" ] && while kill -0 "$(cat "$WORK/stores.pid")" 2>/dev/null; do sleep 2; done; true; }
suite() {  # suite SECONDS STAGE ARGS...: the state is carried in $STATE between stages and calls
  local limit=$1; shift
  local state=(); [ -f "$STATE" ] && state=(--state "$STATE")
  timeout "$limit" python -m benchmarks.suite "$@" --work "$WORK" --out "$OUT/suite" "${state[@]}" ${SUITE_ARGS:-}
  mkdir -p "$(dirname "$STATE")" && cp "$OUT/suite/suite.json" "$STATE"
}
base_tree() {  # BASE_TGZ (default .device/base.tgz: `git archive BASE moestream ':!moestream/demo_model'`) in
  # /tmp/base, made anew each stage (two stages may A/B two bases), with this checkout's benchmarks and demo model
  rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf "${BASE_TGZ:-.device/base.tgz}" -C /tmp/base
  cp -r benchmarks /tmp/base/ && ln -sfn "$PWD/moestream/demo_model" /tmp/base/moestream/demo_model
}
interleaved() {  # interleaved RUN: function RUN in the base tree, then in this one, twice over ($tag: the tree)
  base_tree
  for tree in /tmp/base "$PWD" /tmp/base "$PWD"; do  # python -m imports from the working directory first
    (cd "$tree" && export PYTHONPATH="$tree${SITE:+:$SITE}" tag="$(basename "$tree")" && "$1")
  done
}
ab_fn4() {
  timeout 150 python -m benchmarks.probes.flash_next "$WORK/fn4" --configs graph --out "$OUT/ab-fn4-$tag.jsonl" 2>&1 \
    | grep -o '"prompt".*'
}
ab_prefill() {
  timeout 150 python -m benchmarks.probes.resident "$WORK/q30s" --tag "$tag" 2>&1 | grep '"tag"' | tee -a "$OUT/ab-prefill.log"
}
ab_fn_prefill() {
  timeout 200 python -m benchmarks.probes.resident "$WORK/fn12" --tag "$tag" --lengths 4096 --rounds 3 2>&1 \
    | grep '"tag"' | tee -a "$OUT/ab-fn-prefill.log"
}
ab_batching() {
  timeout 120 python -m benchmarks.batching "$WORK/q30s" /tmp/ab.json --streams 1,16 ${BATCH_ARGS:-} > /dev/null 2>&1 \
    && python -c "import json; [print('$tag', r['streams'], round(r['step_ms'], 3), round(r['vs_one_stream'], 2)) \
for r in json.load(open('/tmp/ab.json'))['rows']]" | tee -a "$OUT/ab-batching.log"
}
ab_mixed() {
  timeout 120 python -m benchmarks.probes.mixed_decode "$WORK/fn12" --tag "$tag" 2>&1 | grep '"tag"' \
    | tee -a "$OUT/ab-mixed.log"
}
ab_speculation() {
  timeout 150 python -m benchmarks.speculation /tmp/spec.json > /dev/null 2>&1 && python -c "import json; \
[print('$tag', r['mode'], '|', r['speculation'], r['task'], round(r['decode_tok_s']), round(r['speed_up'], 2), \
round(r['tokens_per_step'], 2), r.get('steps_at')) for r in json.load(open('/tmp/spec.json'))]" | tee -a "$OUT/ab-speculation.log" \
    && cp /tmp/spec.json "$OUT/spec-$tag-$(date +%H%M%S).json"
}
ab_verify() {
  timeout 240 python -m benchmarks.verify_cost /tmp/vc.json --mtp > /dev/null 2>&1 && python -c "import json; \
[print('$tag', r['mode'], '| all rejected', round(r['decode_tok_s_spec_all_rejected']), 'depth 0', \
round(r['decode_tok_s_spec_depth_0']), 'off', round(r['decode_tok_s_spec_off']), 'paired', \
round(r.get('all_rejected_vs_off_paired', 0), 3), r['speculation']['proposed']) \
for r in json.load(open('/tmp/vc.json'))]" \
    | tee -a "$OUT/ab-verify.log" && cp /tmp/vc.json "$OUT/verify-$tag-$(date +%H%M%S).json"
}
e2e() {  # e2e SECONDS LOG ARGS...: the end-to-end probe on the 30B store (E2E_ARGS adds options)
  local limit=$1 log=$2; shift 2
  wait_stores; timeout "$limit" python -m benchmarks.probes.e2e "$STORE" "$@" ${E2E_ARGS:-} 2>&1 | tee "$OUT/$log.log" | tail -30
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    stores) timeout 580 python -m benchmarks.suite stores --work "$WORK" --out "$OUT/suite" 2>&1 | tee "$OUT/stores.log" ;;
    stores-bg) setsid python -m benchmarks.suite stores --work "$WORK" --out "$OUT/suite" > "$WORK/stores.log" 2>&1 &
               echo $! > "$WORK/stores.pid" ;;  # setsid: the build outlives a call cut short
    limits) wait_stores; suite 120 limits ;;
    tests) timeout "${TESTS_SECONDS:-400}" python -m pytest -q -m gpu tests --ignore=tests/kernels --ignore=tests/quant --ignore=tests/server \
             2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^$" | tail -25 ;;  # kernels, quant: kernel-tests; server: no fastapi there
    invariance) timeout 150 python -m pytest -q -m gpu -s tests/engine 2>&1 | tee "$OUT/gpu-invariance.log" | grep -v "^$" | tail -30 ;;
    kernel-tests) timeout 400 python -m pytest -q -n 8 -m gpu ${KERNEL_TESTS:-tests/kernels tests/quant} 2>&1 \
                  | tee "$OUT/gpu-kernel-tests.log" | tail -4 ;;
    kernels) timeout "${KERNEL_SECONDS:-330}" python -m benchmarks.bench_kernels --quick --tune \
             --phases "${KERNEL_PHASES:-decode,prefill}" --precisions "${KERNEL_PRECISIONS:-q4}" ${KERNEL_ARGS:-} 2>&1 \
             | tee "$OUT/kernels.log" | tail -12 ;;  # KERNEL_ARGS=--host: Q3/Q2 decode read from the host tier
    suite-30b) wait_stores; suite "${SUITE_SECONDS:-580}" moestream --store qwen3-30b="$STORE" --modes q4 ;;
    suite-lowbit) wait_stores; suite "${SUITE_SECONDS:-580}" moestream --store qwen3-30b="$STORE" --modes low-bit ;;
    suite-next) wait_stores; suite "${SUITE_SECONDS:-580}" moestream --store qwen3.8-flash-next="$WORK/qwen3.8-flash-next" ;;
    suite-peers) wait_stores; suite "${PEERS_SECONDS:-${SUITE_SECONDS:-580}}" peers ;;
    llamacpp-build-bg)  # llama-bench for sm_90 from .device/llama.cpp.tar.xz (benchmarks/llamacpp_slim.sh), ~5 min
      mkdir -p "$WORK/lc" && tar xJf .device/llama.cpp.tar.xz -C "$WORK/lc"
      setsid bash benchmarks/llamacpp_build.sh "$WORK/lc/llama.cpp" "$WORK/lc/build" > "$WORK/lc/build.log" 2>&1 &
      echo $! > "$WORK/lc/build.pid" ;;
    suite-llamacpp)  # the GGUF (~19 GB, written while the build runs), then llama-bench's rows into the suite
      export PYTHONPATH="$PYTHONPATH:$(ls "$PWD"/.device/gguf-*.whl | head -1)"  # gguf-py, not on the image
      [ -f "$WORK/qwen3-30b.gguf" ] || python -m benchmarks.llamacpp gguf "$WORK/qwen3-30b.gguf" \
        --tokenizer .device/qwen3-tokenizer.json.gz 2>&1 | tail -2
      while kill -0 "$(cat "$WORK/lc/build.pid")" 2>/dev/null; do sleep 2; done
      cp "$WORK/lc/build.log" "$OUT/llamacpp-build.log"; tail -2 "$WORK/lc/build.log"
      suite "${SUITE_SECONDS:-580}" llamacpp --llama-bench "$WORK/lc/build/bin/llama-bench" ;;
    flagship-store) timeout 580 python -m benchmarks.flagship store --work "$WORK" ${FLAGSHIP_STORE_ARGS:-} 2>&1 | tee "$OUT/flagship-store.log" ;;
    flagship) mkdir -p "$WORK/state"; f="$WORK/state/flagship.json"; st=(); [ -f "$f" ] && st=(--state "$f")
              timeout "${FLAGSHIP_SECONDS:-580}" python -m benchmarks.flagship run --work "$WORK" --out "$OUT/flagship" \
                "${st[@]}" ${FLAGSHIP_ARGS:-} 2>&1 | tee "$OUT/flagship.log" | tail -20
              cp "$OUT/flagship/flagship.json" "$f" ;;  # FLAGSHIP_ARGS="--rows 24gb-host,..."
    train-bg)  # issue 28's demo model: a 30-step probe sizes --steps to ~TRAIN_SECONDS alone, then trains in the background
      data="${TRAIN_DATA:-.device/corpus}"  # train.bin may come gzipped (the tree and the data share 64 MiB)
      [ -f "$data/train.bin.gz" ] && [ ! -f "$data/train.bin" ] && gunzip -k "$data/train.bin.gz"
      T=(--data "$data" --device cuda --batch 64 --seq 512 --lr 2e-3 --warmup 200)
      if [ -n "${TRAIN_STEPS:-}" ]; then steps=$TRAIN_STEPS; else  # TRAIN_STEPS=3858: the shipped model's run
        python -m training.train "${T[@]}" --out "$WORK/probe" --stop-at 30 --eval-every 0 > "$OUT/train-probe.log" 2>&1
        steps=$(python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-2]; \
print(min(6000, int(r['tokens_per_s'] * ${TRAIN_SECONDS:-330} / 32768)))" "$WORK/probe/log.jsonl") || steps=2000
        echo "probe: $(tail -2 "$OUT/train-probe.log" | head -1); --steps $steps"
      fi
      setsid python -m training.train "${T[@]}" --out "$WORK/train" --steps "$steps" --eval-every 500 \
        --ckpt-every 1000 > "$WORK/train.log" 2>&1 & echo $! > "$WORK/train.pid" ;;
    train-wait)  # the exported model comes back as 15 MiB parts: cat model.tgz.* | tar xz
      while kill -0 "$(cat "$WORK/train.pid")" 2>/dev/null; do sleep 2; done
      cp "$WORK/train.log" "$OUT/"; tail -4 "$WORK/train.log"
      tar czf - -C "$WORK/train" model log.jsonl | split -b 15M - "$OUT/model.tgz." ;;
    step-ops)  # a 4-layer Flash-Next slice's decode step, kernels by source line (docs/performance.md's open lead)
      [ -f "$WORK/fn4/manifest.json" ] || python -m benchmarks.synthetic "$WORK/fn4" --geometry qwen3.8-flash-next \
        --layers 4 --sparse q4 --ngram-rows 1000000 > "$OUT/fn4.log" 2>&1
      timeout 300 python -m benchmarks.probes.step_ops "$WORK/fn4" 2>&1 | tee "$OUT/step-ops.log" | head -70 ;;
    ab-fn4)  # the 4-layer Flash-Next slice decoded by the tree at .device/base.tgz and by this one, interleaved
      [ -f "$WORK/fn4/manifest.json" ] || python -m benchmarks.synthetic "$WORK/fn4" --geometry qwen3.8-flash-next \
        --layers 4 --sparse q4 --ngram-rows 1000000 > "$OUT/fn4.log" 2>&1
      interleaved ab_fn4 ;;
    ab-prefill)  # 30B resident: prefill 512/4096 (medians of 7) and one stream's decode by the tree at .device/base.tgz
                 # and by this one, interleaved (`git archive BASE moestream ':!moestream/demo_model' | gzip > .device/base.tgz`)
      q30s
      interleaved ab_prefill ;;
    ab-graphs)  # 30B resident, this tree: whole prompts past 512 eager (512) against padded graphs up to 4096, interleaved
      q30s
      for g in 512 4096 512 4096; do
        timeout 150 python -m benchmarks.probes.resident "$WORK/q30s" --tag "graphs-$g" --prefill-graph-tokens $g \
          --lengths 512,2000,4096 2>&1 | grep '"tag"' | tee -a "$OUT/ab-graphs.log"
      done ;;
    resident-profile) q30s; profile "$WORK/q30s" profile.log --rounds 1 ;;  # the 48-layer 30B
    flash-next-profile) fn12; profile "$WORK/fn12" fn-profile.log --lengths 4096 --rounds 3 ;;  # a 12-layer slice
    ab-fn-prefill)  # the same slice's resident 4096 prefill and decode by the tree at .device/base.tgz and by this one
      fn12
      interleaved ab_fn_prefill ;;
    ab-batching)  # 30B resident, 1 and 16 streams, by the tree at .device/base.tgz and by this one, interleaved
      q30s
      interleaved ab_batching ;;
    ab-mixed)  # Q4 with Q2 misses on a 12-layer Flash-Next slice (25% pool + host), base tree and this one, interleaved
      fn12
      interleaved ab_mixed ;;
    ab-speculation)  # the demo model's speculation table (benchmarks/speculation.py) by the base tree and this one
      interleaved ab_speculation ;;
    ab-verify)  # verify_cost --mtp (30B, 8 layers): every draft rejected against speculation off, base tree and this one
      interleaved ab_verify ;;
    gemv) timeout 120 python -m benchmarks.probes.gemv 2>&1 | tee "$OUT/gemv.log" ;;
    e2e) e2e 300 e2e --decode --prefill ;;
    decode) e2e 200 decode --decode --profile ;;
    overlap) e2e 240 overlap --prefill --fracs 0.25 --lengths 4096 --host-gb 24 --warm --trace ;;
    *) echo "unknown stage: $stage" ;;
  esac
done
wait_stores
[ -f "$WORK/stores.log" ] && cp "$WORK/stores.log" "$OUT/"
echo "=== done $(date +%T)"
tar czf "$WORK/results.tgz" --exclude='./model.tgz.*' -C "$OUT" . \
  && find "${OUT:?}" -mindepth 1 -maxdepth 1 ! -name 'model.tgz.*' -exec rm -rf {} + && mv "$WORK/results.tgz" "$OUT/"
