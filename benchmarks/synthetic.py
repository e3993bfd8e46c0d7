"""Real-geometry stores from random weights, written through the store format and the packer's writers
(there are no real weights on the GPU machine). Records are random Q4 codes with sane scales; dense
tensors are random bf16 named as the model expects. `skew` makes expert popularity uneven by scaling
router rows (a larger row wins top-k more often), since random routers spread tokens evenly; `routing`
instead takes a recorded routing trace (`moestream generate --trace-routing`) and scales them so that each
layer's popularity curve follows the trace's layer at the same depth (`follow_trace`; a trained model's
token-to-token reuse is not reproduced).

"qwen3.8-flash-next" is the flagship's whole geometry: 48 layers (36 Gated DeltaNet, 12 QSA), one PLE block
whose q4 n-gram table has 16 heads of `--ngram-rows` rows (the model's own: 20M, 32 GB; a token's cost does
not depend on it). Values the public configs do not give are marked "inferred" below.

python -m benchmarks.synthetic OUT --geometry qwen3-30b [--layers N] [--skew 1.0 | --routing TRACE] [--ngram-rows N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from moestream.config import PRECISIONS, ModelConfig
from moestream.experts.format import (
    DENSE_FILE,
    MANIFEST,
    ExpertGeometry,
    Manifest,
    NgramLayout,
    RecordLayout,
    experts_file,
    ngram_file,
)
from moestream.layers.moe import SparseMoE
from moestream.models import model_class
from moestream.models.mtp import head_class
from moestream.packer.checks import file_check
from moestream.packer.safetensors_io import SafetensorsWriter, read_header
from moestream.stats.trace import Trace
from moestream.stats.trace import load as load_trace

GEOMETRIES = {
    "qwen3-30b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                      intermediate_size=6144, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                      rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, eos_token_id=151645,
                      tie_word_embeddings=False),
    "qwen3.8-flash-next": dict(model_type="qwen4_exp_text", vocab_size=248320, hidden_size=2560,
                               num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               moe_intermediate_size=640, shared_expert_intermediate_size=640, num_experts=512,
                               num_experts_per_tok=10, linear_num_key_heads=16, linear_num_value_heads=48,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               hc_count=4, hc_lowrank=320, rms_norm_eps=1e-6, eos_token_id=248044,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25},
                               full_attention_interval=4, tie_word_embeddings=False, output_gate_type="sigmoid",
                               # inferred (cherenkov.md 1.1): QSA and the one PLE block
                               indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
                               indexer_compress_ratio=4, ple_layer_ids=[1], ple_embed_dim=2560, ngram_size=3,
                               heads_per_ngram=8, ngram_vocab_size_base=20_000_000, ple_conv_kernel_size=4),
}
NGRAM_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


# Random blocks add similar outputs to every token, and over 48 layers that common part swamps the token's
# own embedding until all tokens route alike; a large embedding and small block outputs keep routing diverse.
EMBED_SCALE, BLOCK_OUT_SCALE = 8.0, 0.05


def build(out: str, geometry: str, layers: int | None = None, skew: float = 0.0, seed: int = 0,
          precisions: tuple[str, ...] = ("q4",), sparse: tuple[str, ...] = (), mtp: bool = False,
          routing: str | None = None, **overrides) -> Manifest:
    """`sparse`: precisions whose records are holes in a sparse file (zero codes, scales and biases: zero experts,
    read and computed like any others, for stores larger than the disk)."""
    hf = dict(GEOMETRIES[geometry]) | overrides
    if layers:
        hf["num_hidden_layers"] = layers
        hf["ple_layer_ids"] = [i for i in hf.get("ple_layer_ids", []) if i <= layers]
    if "full_attention_interval" in hf:
        n, k = hf["num_hidden_layers"], hf.pop("full_attention_interval")
        hf["layer_types"] = ["linear_attention" if (i + 1) % k else "full_attention" for i in range(n)]
    if mtp:
        hf["mtp_num_hidden_layers"] = 1
    cfg = ModelConfig.from_hf(hf)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(seed)
    dev = gen.device
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
        if mtp:  # its dense tensors too, so that --spec mtp runs on the store
            model.mtp = head_class(model)(cfg, model.spec)
    hashing = {}
    for layer in cfg.ple_layer_ids:
        hashing |= {f"model.layers.{layer}.ple.ple_embedding.{k}": v
                    for k, v in zip(NGRAM_BUFFERS, ngram_hashing(cfg, hf["ngram_vocab_size_base"], seed + layer))}
    specs = [(n, torch.long if n in hashing else torch.bfloat16, tuple(t.shape)) for n, t in model.state_dict().items()]
    writer = SafetensorsWriter(os.path.join(out, DENSE_FILE), specs)
    for name, _, shape in specs:
        if name in hashing:
            writer.write(name, hashing[name])
            continue
        if name.endswith("norm.weight") or "norm" in name.split(".")[-2]:
            t = torch.ones(shape) if not cfg.is_hybrid else torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen, device=dev) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.1)
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                t = t * BLOCK_OUT_SCALE
            if name.endswith("embed_tokens.weight"):
                t = t * EMBED_SCALE
            if name.endswith("mlp.gate.weight") and skew:
                t = t * torch.arange(1, shape[0] + 1, device=dev).float().pow(-skew)[:, None] * shape[0] ** (skew / 2)
        writer.write(name, t.to(torch.bfloat16).cpu())
    writer.close()
    layer_ids = cfg.moe_layer_ids + ((-1,) if mtp else ())  # the MTP layer's experts: one more record layer
    g = ExpertGeometry(len(layer_ids), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, layer_ids)
    layouts = {p: RecordLayout.build(p, cfg.hidden_size, cfg.moe_intermediate_size) for p in precisions}
    for p, layout in layouts.items():
        write_records(os.path.join(out, experts_file(p)), g, layout, PRECISIONS[p], gen, sparse=p in sparse)
    ngram = tuple(write_ngram_table(out, layer, hashing, cfg, gen) for layer in cfg.ple_layer_ids)
    names = (DENSE_FILE, *map(experts_file, layouts), *(ngram_file(n.layer) for n in ngram))
    files = {name: file_check(os.path.join(out, name)) for name in names}
    source = {"kind": "synthetic", "geometry": geometry, "skew": skew, "sparse": sorted(sparse)}
    manifest = Manifest(cfg.model_type, hf, source, "bfloat16", g, layouts, ngram, (), files)
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
    return follow_trace(out, routing, seed) if routing else manifest


def follow_trace(out: str, routing: str, seed: int = 0, tokens: int = 384, passes: int = 2) -> Manifest:
    """Scale the routers of the store at `out` so that each layer's expert popularity follows the trace's layer at
    the same depth, calibrated on the router inputs of the store's own model's decode steps, every layer at once,
    `passes` times (a layer's new routing moves the inputs of the layers after it; calibrated on isotropic inputs
    instead, deeper layers collapsed onto a few experts). The new rows are written over the old ones."""
    from moestream.engine.llm import LLM
    from moestream.sampling import SamplingParams

    curves = popularity(load_trace(routing))
    llm = LLM(out, warm=False, decode_mode="eager")  # eager: the hooks see every step
    gen = torch.Generator(device=llm.device).manual_seed(seed)
    prompt = torch.randint(0, llm.config.vocab_size, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
    blocks = [(name, m) for name, m in llm.model.named_modules() if isinstance(m, SparseMoE)]
    original = {name: block.gate.weight.float().clone() for name, block in blocks}
    for _ in range(passes):
        inputs = {name: [] for name, _ in blocks}
        hooks = [block.register_forward_pre_hook(lambda module, args, seen=inputs[name]: seen.append(args[0]))
                 for name, block in blocks]
        llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=seed))
        for hook in hooks:
            hook.remove()
        for i, (name, block) in enumerate(blocks):
            x = torch.cat(inputs[name][1:]).float()  # the decode steps' rows, not the prompt's
            weight = original[name]
            shares = resample(curves[i * len(curves) // len(blocks)], weight.shape[0])
            block.gate.weight.copy_(weight * router_scales(x, weight, shares, block.top_k, gen)[:, None])
    rows = {f"{name}.gate.weight": block.gate.weight.to(torch.bfloat16) for name, block in blocks}
    llm.close()
    dense = os.path.join(out, DENSE_FILE)
    places = read_header(dense)
    with open(dense, "r+b") as f:
        for name, t in rows.items():
            f.seek(places[name].start)
            f.write(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    with open(os.path.join(out, MANIFEST)) as f:
        m = Manifest.from_json(json.load(f))
    m = dataclasses.replace(m, files={**m.files, DENSE_FILE: file_check(dense)},
                            source={**m.source, "routing": os.path.basename(routing)})
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(m.to_json(), f, indent=1)
    return m


def popularity(trace: Trace) -> list[torch.Tensor]:
    """Each traced MoE layer's expert shares, most used first (layers the trace never used are left out)."""
    counts = torch.zeros(trace.layers, trace.experts)
    for step in trace.steps:
        for row in step.rows:
            counts[step.layer, row] += 1
    return [(c / c.sum()).sort(descending=True).values for c in counts if c.sum() > 0]


def resample(curve: torch.Tensor, experts: int) -> torch.Tensor:
    """A most-used-first share curve over n experts as one over `experts`: its cumulative share, linear in
    between, read at the same fractions of the experts."""
    n = curve.numel()
    cumulative = torch.cat([torch.zeros(1), curve.cumsum(0)])
    at = torch.linspace(0, n, experts + 1)
    lo = at.floor().long().clamp(max=n - 1)
    return (cumulative[lo] + (at - lo) * (cumulative[lo + 1] - cumulative[lo])).diff()


def router_scales(x: torch.Tensor, weight: torch.Tensor, shares: torch.Tensor, top_k: int, gen: torch.Generator,
                  rounds: int = 60) -> torch.Tensor:
    """Row scales for a router [E, H] such that top-k over the inputs `x` [N, H] picks the experts with `shares`
    (most used first), given to the experts in a random order: a larger row wins more often. Bounded: an expert
    that never wins would otherwise grow its row until the router's softmax saturates and ties decide."""
    experts, samples = weight.shape[0], x.shape[0]
    logits = (x @ weight.T).to(gen.device)
    target = torch.empty(experts, device=gen.device)
    target[torch.randperm(experts, generator=gen, device=gen.device)] = shares.to(gen.device) * top_k
    scales = torch.ones(experts, device=gen.device)
    for _ in range(rounds):
        picks = (logits * scales).topk(top_k, dim=1).indices
        freq = torch.bincount(picks.flatten(), minlength=experts) / samples
        scales = (scales * ((target + 1 / samples) / (freq + 1 / samples)) ** 0.5).clamp(0.1, 12.0)
    return scales.to(weight.device)


def write_records(path: str, g: ExpertGeometry, layout: RecordLayout, bits: int, gen: torch.Generator,
                  sparse: bool = False) -> None:
    """Random codes; scales small and biases centring the codes, w = s q + b within +-(2^bits - 1)/2 s (so
    activations stay sane)."""
    with open(path, "wb") as f:
        if sparse:
            f.truncate(g.num_records * layout.stride)
            return
        for _ in range(g.num_layers):
            words = torch.randint(-2**31, 2**31 - 1, (g.num_experts, layout.stride // 4), generator=gen,
                                  device=gen.device, dtype=torch.int32)
            recs = words.view(torch.uint8).view(g.num_experts, layout.stride)
            for fld in layout.fields:
                if fld.dtype == "bfloat16":
                    scale = 0.0005 if fld.name.startswith("down") else 0.002
                    recs[:, fld.offset: fld.offset + fld.nbytes].view(torch.bfloat16).fill_(
                        scale if fld.name.endswith("_s") else -(2**bits - 1) / 2 * scale)
            f.write(recs.cpu().numpy().tobytes())


def ngram_hashing(cfg: ModelConfig, rows_per_head: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A PLE block's hashing buffers: odd multipliers small enough that id * multiplier fits int64, and heads of
    `rows_per_head` rows each (the model's are primes near it; any size hashes alike)."""
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    bound = ((1 << 63) - 1) // cfg.vocab_size // 2
    multipliers = torch.randint(0, bound, (cfg.ngram_size,), generator=torch.Generator().manual_seed(seed)) * 2 + 1
    sizes = torch.full((heads,), rows_per_head, dtype=torch.long)
    return multipliers, sizes, torch.arange(heads, dtype=torch.long) * rows_per_head


def write_ngram_table(out: str, layer: int, hashing: dict, cfg: ModelConfig, gen: torch.Generator) -> NgramLayout:
    """Random q4 rows (group 32) with the scales the expert records get, written in chunks."""
    prefix = f"model.layers.{layer}.ple.ple_embedding."
    rows = int((hashing[prefix + "ngram_heads_offsets"] + hashing[prefix + "ngram_heads_vocab_sizes"]).max())
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    layout = NgramLayout.build(layer, rows, cfg.ple_embed_dim // heads, "q4")
    groups = layout.dim // layout.group_size
    with open(os.path.join(out, ngram_file(layer)), "wb") as f:
        for start in range(0, rows, 1 << 22):
            n = min(1 << 22, rows - start)
            raw = torch.randint(0, 256, (n, layout.row_bytes), generator=gen, device=gen.device, dtype=torch.uint8)
            scales = raw[:, layout.dim // 2:].view(torch.bfloat16)
            scales[:, :groups], scales[:, groups:] = 0.002, -7.5 * 0.002
            f.write(raw.cpu().numpy().tobytes())
    return layout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--geometry", default="qwen3-30b", choices=sorted(GEOMETRIES))
    p.add_argument("--layers", type=int)
    p.add_argument("--skew", type=float, default=0.0)
    p.add_argument("--routing", help="a routing trace whose per-layer expert popularity the routers follow")
    p.add_argument("--ngram-rows", type=int, help="rows per n-gram head (flash-next; default the model's 20M)")
    p.add_argument("--precisions", default="q4", help="record files to write, e.g. q4,q2")
    p.add_argument("--sparse", default="", help="precisions written as holes (zero experts), e.g. q4")
    p.add_argument("--mtp", action="store_true",
                   help="an MTP head: its dense tensors, and its experts as one more record layer")
    args = p.parse_args()
    extra = {"ngram_vocab_size_base": args.ngram_rows} if args.ngram_rows else {}
    m = build(args.out, args.geometry, args.layers, args.skew, precisions=tuple(args.precisions.split(",")),
              sparse=tuple(filter(None, args.sparse.split(","))), mtp=args.mtp, routing=args.routing, **extra)
    size = sum(f.size for f in m.files.values()) / 1e9
    print(f"wrote {args.geometry} ({m.geometry.num_layers} expert layers, {m.geometry.num_records} records): "
          f"{size:.1f} GB in {args.out}")


if __name__ == "__main__":
    main()
