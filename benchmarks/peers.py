"""The peers, run on the same geometry and prompts as moestream: transformers with the whole bf16 model on
the GPU, and transformers + accelerate with the routed experts offloaded to CPU RAM (`dispatch_model`)."""

from __future__ import annotations

import random
import time

import torch

from moestream.experts.store import open_store

# transformers builds qwen4_exp's full-attention layers with their QSA indexer; the suite's flash-next geometry
# has none, so the peer's indexer gets a budget over every prompt: it keeps all tokens, full attention, as ours
QSA_FOR_ALL_TOKENS = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=8192,
                          indexer_compress_ratio=4)


def _hf_model(store: str, device: str):
    """The store's architecture in transformers. On the CPU the weights are zeros: random init of a 61 GB
    model there took over 220 s, and the timing does not depend on the values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(open_store(store).manifest.config)
    if cfg["model_type"].startswith("qwen4_exp") and cfg.get("indexer_budget") is None:
        cfg |= QSA_FOR_ALL_TOKENS
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device if device != "cpu" else "meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if device == "cpu":
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.zero_()
    return model.eval()


@torch.inference_mode()
def _rates(model, vocab: int, device: str, decode_tokens: int, prefill: tuple[int, ...],
           warm: bool = True) -> list[dict]:
    """`warm`: run each prefill length once untimed first (a first call at a new length builds cuDNN's attention
    graph, ~0.5 s; worth skipping only where a call takes many seconds anyway)."""
    rng = random.Random(0)
    out = []
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(16)]], device=device)
    model.generate(ids, max_new_tokens=2, do_sample=False)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
    torch.cuda.synchronize()
    out.append({"scenario": "decode", "tokens": 16, "rate": decode_tokens / (time.perf_counter() - start)})
    for n in prefill:
        ids = torch.tensor([[rng.randrange(vocab) for _ in range(n)]], device=device)
        if warm:
            model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
        out.append({"scenario": "prefill", "tokens": n, "rate": n / (time.perf_counter() - start)})
    return out


def expert_offload_map(model) -> dict[str, str | int]:
    """A disjoint device map: every routed-expert module on "cpu", everything else on GPU 0."""
    out: dict[str, str | int] = {"lm_head": 0}
    for name, _ in model.model.named_children():
        if name != "layers":
            out[f"model.{name}"] = 0
    for i, layer in enumerate(model.model.layers):
        for name, _ in layer.named_children():
            if name != "mlp":
                out[f"model.layers.{i}.{name}"] = 0
        for name, _ in layer.mlp.named_children():
            out[f"model.layers.{i}.mlp.{name}"] = "cpu" if name == "experts" else 0
    return out


def run_peers(stores: dict[str, str], offload_tokens: int = 3, on_rows=None) -> list[dict]:
    """Both peers on each store ({suite model name: path}); a peer that cannot run on this machine (its
    transformers lacks the architecture, or the model does not fit) leaves a row with its reason instead.
    `on_rows(rows so far)` after each peer, so that a call cut short keeps what ran."""
    runs = []
    for name, store in stores.items():
        for engine, run in (("transformers (GPU)", _on_gpu),
                            ("transformers + accelerate (experts on CPU)", _offloaded)):
            try:
                rows = run(store, offload_tokens)
            except Exception as e:  # the reason goes in the report, and the other peers still run
                rows = [{"scenario": "decode", "tokens": 16, "rate": None, "error": f"{type(e).__name__}: {e}"[:200]}]
            finally:
                torch.cuda.empty_cache()
            offloaded = engine.startswith("transformers +")
            for r in rows:
                runs.append({"model": name, "engine": engine, "pool": 0.0 if offloaded else 1.0,
                             "host_tier": offloaded, **r})
                print(runs[-1])
            if on_rows:
                on_rows(runs)
    return runs


def _on_gpu(store: str, offload_tokens: int) -> list[dict]:
    model = _hf_model(store, "cuda")
    return _rates(model, model.config.vocab_size, "cuda", 32, (512, 4096))


def _offloaded(store: str, offload_tokens: int) -> list[dict]:
    from accelerate import dispatch_model

    model = _hf_model(store, "cpu")
    model = dispatch_model(model, device_map=expert_offload_map(model))
    return _rates(model, model.config.vocab_size, "cuda", offload_tokens, (512, 4096), warm=False)
