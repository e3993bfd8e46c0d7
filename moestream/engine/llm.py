"""The public engine API: `LLM(store, ...)` with `logits`, `generate`, `chat`, `stream` and `stats`.

Prompts are prefilled in chunks of `prefill_chunk` tokens cut at fixed positions; with `prefix_cache_mb`
> 0 the states at those cuts are kept (engine/prefix_cache.py) and a prompt that repeats a cached prefix
prefills only the rest, with the same output as an uncached run."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moestream.config import EngineConfig, ExpertConfig
from moestream.engine import generate as gen
from moestream.engine.decode import CudaDecoder, supports_static_decode
from moestream.engine.loader import load_model
from moestream.engine.prefix_cache import PrefixCache
from moestream.engine.stream import RequestOutput, TextStream
from moestream.errors import MoestreamError
from moestream.experts.format import precision_name
from moestream.experts.provider import StreamingProvider
from moestream.experts.store import open_store
from moestream.sampling import SamplingParams


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM:
    def __init__(self, store: str, device: str | None = None, dtype: str | None = None, pool_gb: float | None = None,
                 host_gb: float = 0.0, experts: int = 4, decode_mode: str = "graph", preload: bool | None = None,
                 max_context: int = 8192, prefill_chunk: int = 4096, prefix_cache_mb: float = 0.0,
                 miss_experts: int | None = None, **expert_options):
        device = device or default_device()
        if device == "cuda" and not torch.cuda.is_available():
            raise MoestreamError("--device cuda was asked for, but no CUDA device is available")
        dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
        try:
            precision = precision_name(experts)
            miss = precision_name(miss_experts) if miss_experts else None
        except ValueError as e:
            raise MoestreamError(str(e)) from None
        if miss is not None and (precision != "q4" or miss not in ("q3", "q2")):
            raise MoestreamError("--miss-experts takes 3 or 2, with --experts 4")
        expert_cfg = ExpertConfig(precision=precision, pool_gb=pool_gb, host_gb=host_gb, miss_precision=miss,
                                  **expert_options)
        if expert_cfg.ring_slots < 1 or expert_cfg.ring_group < 1:
            raise MoestreamError("need --ring >= 1 and --group >= 1")
        if prefill_chunk < 1 or prefix_cache_mb < 0:
            raise MoestreamError("need prefill_chunk >= 1 and prefix_cache_mb >= 0")
        self.engine_config = EngineConfig(device=device, dtype=dtype, experts=expert_cfg, prefill_chunk=prefill_chunk)
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self.store = open_store(store)
        for p in {precision, miss} - {None} - set(self.store.manifest.layouts):
            if p in ("q3", "q2") and "q4" in self.store.manifest.layouts:  # built from Q4 on first use
                from moestream.packer.lowbit import ensure_precision

                ensure_precision(store, p)
                self.store = open_store(store)
            self.store.experts_path(p)  # refuses a precision the store lacks, before loading anything
        self.config = self.store.model  # the model (ModelConfig); engine options are in engine_config
        self.model = load_model(self.store, self.device, self.dtype)
        self.provider = StreamingProvider(self.store, expert_cfg, self.device, self.config.num_experts_per_tok)
        blocks = self.model.moe_blocks()
        for block in blocks:
            block.provider = self.provider
        self.provider.attach({b.layer_slot: b.gate.weight for b in blocks})
        self._tokenizer = None
        self.decoder = None
        if self.device.type == "cuda" and supports_static_decode(self.model):
            self.decoder = CudaDecoder(self.model, self.provider, max_context, mode=decode_mode)
        if preload if preload is not None else self.device.type == "cuda":
            from moestream.engine.progress import progress_bar

            with progress_bar("loading experts", self.provider.geometry.num_layers) as advance:
                self.provider.preload(lambda done, total: advance(done))
        self.prefix_cache = None
        if prefix_cache_mb > 0:
            self.prefix_cache = PrefixCache(int(prefix_cache_mb * 1e6), prefill_chunk, self.device)

    def _step(self):
        return self.decoder.step if self.decoder else None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from moestream.engine.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.store.path)
        return self._tokenizer

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        try:
            ids |= self.tokenizer.eos_ids
        except MoestreamError:
            pass
        return ids

    @torch.inference_mode()
    def logits(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """One prompt's full-sequence logits [T, vocab] (float32)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        state = self.model.new_state(self.dtype, self.device)
        return self.model.logits(self.model(ids, state))

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[gen.Step]:
        yield from self._run(self._sequence(prompt_ids, params))

    def _sequence(self, ids: list[int], params: SamplingParams) -> gen.Sequence:
        """A new sequence for `ids`, starting from the deepest cached prefix when there is one."""
        params.validate()
        if not ids:
            raise MoestreamError("the prompt is empty")
        cached, state = self.prefix_cache.restore(ids) if self.prefix_cache else (0, None)
        seq = gen.Sequence(list(ids), params, state or self.model.new_state(self.dtype, self.device))
        seq.timings.cached_tokens = cached
        return seq

    def _run(self, seq: gen.Sequence) -> Iterator[gen.Step]:
        keep = self.prefix_cache.insert if self.prefix_cache else None
        yield from gen.run(self.model, seq, self.eos_ids, self.engine_config.prefill_chunk, self.device,
                           step=self._step(), on_boundary=keep)

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Prompts are strings (tokenized raw, no chat template) or lists of token ids."""
        params = params or SamplingParams()
        outs = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            outs.append(self._complete(ids, params))
        return outs

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self._complete(self.tokenizer.chat(messages), params or SamplingParams())

    def _complete(self, ids: list[int], params: SamplingParams) -> RequestOutput:
        stream = TextStream(self, ids, params)  # the same path as streaming: stop strings included
        for _ in stream:
            pass
        return stream.output()

    def _text(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except MoestreamError:
            return ""

    def stats(self) -> dict:
        return self.provider.snapshot()

    def close(self) -> None:
        self.provider.close()

