"""The expert kernels compiled for sm_90 without a GPU: registers, spills, and the SASS instructions of the hot
loop (up to the last backward branch; the whole kernel if none), by opcode. Device time is scarce: most kernel leads in
docs/performance.md came from these counts.

python -m benchmarks.probes.sass_counts KERNEL [NAME=VALUE ...]   (needs triton; kernels and defaults in KERNELS)
python -m benchmarks.probes.sass_counts prefill-gate-up JOIN=0 BN=64 --warps 8 --stages 3
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

# kernel -> (module, function, constexpr defaults: one Qwen3-30B-A3B layer with the committed Q4 tiles)
GEOMETRY = dict(H=2048, I=768, GROUP=64, BITS=4)
KERNELS = {
    "prefill-gate-up": ("expert_mlp", "gate_up_kernel",
                        dict(TOP_K=8, BM=256, BN=128, BK=64, SWAP=1, JOIN=1, SPARSE=0)),
    "prefill-down": ("expert_mlp", "down_kernel",
                     dict(BM=256, BN=128, BK=64, SWAP=1, SPARSE=0)),
    "decode-gate-up": ("expert_gemv", "gate_up_gemv_kernel",
                       dict(TOP_K=8, BN=8, BK=2048, SPAN=2048, AHEAD=0, PDL=1, INDIRECT=1, SELECT=0, TAIL1=0, TAIL2=0,
                            MISS_BITS=0, MISS_BK=0, MISS_SPAN=0, MISS_TAIL1=0, MISS_TAIL2=0)),
    "decode-down": ("expert_gemv", "down_gemv_kernel",
                    dict(BN=16, BK=1024, SPAN=0, AHEAD=0, PDL=1, INDIRECT=1, SELECT=0, TAIL1=512, TAIL2=256,
                         MISS_BITS=0, MISS_BK=0, MISS_SPAN=0, MISS_TAIL1=0, MISS_TAIL2=0)),
    "prefill-glue": ("rowwise", "qk_norm_rope_cache_kernel",
                     dict(HEADS=32, KV_HEADS=4, D=128, Q_STRIDE=128, ROT=128, BLOCK=128, ROWS=8, QK_NORM=1,
                          ZERO_CENTERED=0, MAP=1, OFFSETS=0)),
    "prefill-wgmma-gate-up": ("expert_wgmma", "gate_up_kernel", dict(TOP_K=8, BM=128, STAGES=3, SPARSE=0)),
    "prefill-wgmma-down": ("expert_wgmma", "down_kernel", dict(BM=128, STAGES=3, SPARSE=0)),
    "tile-counts": ("expert_tiles", "expert_counts_kernel", dict(BLOCK_E=128, CHUNK=1024, PADDED=0)),
    "tile-tables": ("expert_tiles", "tile_tables_kernel",
                    dict(E=128, BLOCK_E=128, SUM_ROWS=32, BM=256, TAIL_BM=64, TILES=64, PADDED=0)),
}
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "counts_ptr": "*i32", "uses_ptr": "*i32"}
POINTERS |= {f"{a}_ptr": "*bf16" for a in ("qkv", "qw", "kw", "cos", "sin", "q", "k_cache", "v_cache")}
FLOATS = {"eps"}  # the rest: *i64 tables, i64 strides, i32 sizes


def compile_sm90(kernel: str, constants: dict, warps: int, stages: int):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, defaults = KERNELS[kernel]
    kernels = importlib.import_module(f"moestream.kernels.triton.{module}")
    fn = getattr(kernels, name)
    const = {**GEOMETRY, **defaults, **constants}
    if module == "expert_wgmma":  # Gluon: its layouts are constexprs too
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

        const |= kernels.layouts(const["BM"], warps)
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    signature = {}
    for arg in fn.arg_names:
        if arg in const:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = POINTERS.get(arg, "*i64")
        else:
            signature[arg] = "fp32" if arg in FLOATS else "i64" if arg.endswith("stride") else "i32"
    # what a launch specialises on: record fields and offsets are multiples of 16 bytes
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def loop_counts(sass: str) -> tuple[str, collections.Counter]:
    """Opcodes between the target of the last backward branch and that branch (the K loop, once per step), or of
    the whole kernel when it has no loop (a decode GEMV whose chunk is all of K)."""
    ins = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
           if (m := re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line))]
    where = {a: i for i, (a, _) in enumerate(ins)}
    body = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            body = ins[where[int(m.group(1), 16)]: i + 1]
    scope = "loop" if body else "kernel"
    return scope, collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in body or ins)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kernel", choices=sorted(KERNELS))
    p.add_argument("constants", nargs="*", help="NAME=VALUE constexprs over the defaults (BITS=3, JOIN=0, ...)")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--dump", help="write the whole SASS here")
    args = p.parse_args()
    constants = {k: int(v) for k, v in (c.split("=", 1) for c in args.constants)}
    compiled = compile_sm90(args.kernel, constants, args.warps, args.stages)
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    if args.dump:
        with open(args.dump, "w") as out:
            out.write(sass)
    registers, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    scope, counts = loop_counts(sass)
    per = "a warp a step" if scope == "loop" else "a warp"
    print(f"{args.kernel} {constants}: {registers} registers, stack {stack} bytes; {scope}: {sum(counts.values())} "
          f"instructions {per}")
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(24)))


if __name__ == "__main__":
    main()
