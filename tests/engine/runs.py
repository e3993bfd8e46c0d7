"""Driving the engine the way the invariance tests need: prefill + greedy steps, collecting every logit."""

from __future__ import annotations

import torch

from moestream.engine.llm import LLM


@torch.inference_mode()
def greedy_trace(llm: LLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt`, then `steps` greedy tokens; returns (tokens, logits of every position [T+steps, V])."""
    state = llm.model.new_state(llm.dtype, llm.device)
    logits = [llm.model.logits(llm.model(torch.tensor(prompt, device=llm.device), state))]
    tokens = []
    step = llm._step()  # the CUDA decoder on GPU (graphs or the handshake), else the eager forward
    for _ in range(steps):
        token = int(torch.argmax(logits[-1][-1]))
        tokens.append(token)
        if step is not None:
            logits.append(step(token, state)[None])
        else:
            logits.append(llm.model.logits(llm.model(torch.tensor([token], device=llm.device), state)))
    return tokens, torch.cat(logits).cpu()


def prompt_of(llm: LLM, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, llm.config.vocab_size, (n,), generator=g).tolist()
