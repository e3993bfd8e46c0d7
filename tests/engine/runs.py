"""Driving the engine the way the invariance tests need: prefill + greedy steps, collecting every logit."""

from __future__ import annotations

import torch

from moestream.engine.llm import LLM


@torch.inference_mode()
def greedy_trace(llm: LLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt` as a request does, then `steps` greedy tokens; returns (tokens, logits of every position
    [T+steps, V])."""
    state = llm.decoder.new_state()  # on the GPU the decoder's own: its graph replays
    logits = [llm.model.logits(llm.prefiller(prompt, state))]  # padded, or a CUDA graph, as a request's
    tokens = []
    for _ in range(steps):
        token = int(torch.argmax(logits[-1][-1]))
        tokens.append(token)
        logits.append(llm.decoder.step(token, state)[None])  # graphs or the handshake on GPU, else eager
    return tokens, torch.cat(logits).cpu()


def prompt_of(llm: LLM, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, llm.config.vocab_size, (n,), generator=g).tolist()


def static_hyper_store(path: str) -> str:
    """A tiny qwen4_exp store without PLE layers or indexed attention (the suite's Qwen3.8-Flash-Next geometry
    scaled down), whose decode steps are static: built by the benchmarks' synthetic writer, as transformers
    cannot build qwen4_exp without its indexer."""
    from benchmarks.synthetic import build

    build(path, "qwen3.8-flash-next", layers=4, vocab_size=320, hidden_size=64, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, shared_expert_intermediate_size=64,
          num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
          linear_key_head_dim=16, linear_value_head_dim=16, hc_count=2, hc_lowrank=16, ple_layer_ids=[],
          indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None,
          indexer_compress_ratio=None)
    return path
