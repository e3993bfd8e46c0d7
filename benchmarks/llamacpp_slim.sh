#!/usr/bin/env bash
# Packs the part of a llama.cpp source tree that building `llama-bench` (CPU or CUDA) needs:
# `bash benchmarks/llamacpp_slim.sh SRC OUT.tar.xz` (the tree unpacks as llama.cpp/).
# Nothing is patched: what the CMakeLists add unconditionally stays (tools/mtmd, vendor/miniaudio, app/...);
# what only optional targets use goes (docs, vocab files, tests, examples, other backends, the server and its UI).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 SRC OUT.tar.xz" >&2; exit 2; }
SRC=$(cd "$1" && pwd) OUT=$2
[ -f "$SRC/CMakeLists.txt" ] && [ -d "$SRC/ggml/src/ggml-cuda" ] || { echo "error: $SRC is not a llama.cpp tree" >&2; exit 2; }
drop=(
  .git .github .devops .gemini .pi docs media models tests examples pocs benches ci scripts skills conversion
  gguf-py grammars requirements 'convert_*.py' tools/server tools/ui tools/cli tools/rpc tools/tuning
  'tools/mtmd/test-*' tools/mtmd/tests ggml/src/ggml-cpu/kleidiai/tests
)
# backends other than the CPU and CUDA ones are only added when their GGML_<NAME> option is on
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  drop+=("ggml/src/ggml-$b")
done
base=$(basename "$SRC") excludes=(--anchored)
for d in "${drop[@]}"; do excludes+=(--exclude="$base/$d"); done
tar -C "$(dirname "$SRC")" "${excludes[@]}" --transform "s,^$base,llama.cpp," -cf - "$base" | xz -T0 -6 > "$OUT"
echo "$OUT: $(du -h "$OUT" | cut -f1)"
