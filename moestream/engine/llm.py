"""The public engine API: `LLM(store, config, **overrides)` with `logits`, `generate`, `chat`, `stream` and `stats`.

Every option is a field of `EngineConfig` (or of its `ExpertConfig`, named directly: `LLM(store, pool_gb=20)`).
Prompts are prefilled in chunks of `prefill_chunk` tokens cut at fixed positions; with `prefix_cache_mb` > 0 the
states at those cuts are kept (engine/prefix_cache.py) and a prompt that repeats a cached prefix prefills only the
rest, with the same output as an uncached run. On CUDA the load ends by warming every kernel variant a request
uses and capturing the decode graph, so the first request runs as fast as the tenth.
"""

from __future__ import annotations

import dataclasses
import gc
import numbers
import os
from collections.abc import Iterator

import torch

from moestream.config import EngineConfig
from moestream.engine import generate as gen
from moestream.engine.decode import Decoder
from moestream.engine.drafting import FusedDrafts, HeadDecoder, HeadDrafts
from moestream.engine.loader import load_model, ngram_stats, ngram_tables
from moestream.engine.memory import activation_bytes, dense_bytes, kv_row_bytes, plan_gpu, state_bytes
from moestream.engine.prefill import Prefiller, padded_sizes
from moestream.engine.prefix_cache import PrefixCache
from moestream.engine.scheduler import Request, Scheduler
from moestream.engine.speculation import Depth, SpecStats, Speculator
from moestream.engine.stream import RequestOutput, TextStream
from moestream.errors import BudgetError, ConfigError, MoestreamError, RequestError
from moestream.experts.provider import ExpertProvider, ExpertStep
from moestream.experts.store import open_store
from moestream.layers.context import StepContext
from moestream.layers.kv import BLOCK_ROWS
from moestream.models.mtp import head_class
from moestream.sampling import SamplingParams


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_mtp_head(store) -> None:
    model_type = store.model.model_type
    if not any(layer < 0 for layer in store.manifest.geometry.layer_ids):
        raise ConfigError(f"--spec mtp: this {model_type} store has no MTP head (its checkpoint had no mtp.* "
                          "tensors); use --spec lookup")


class LLM:
    def __init__(self, store: str, config: EngineConfig | None = None, **overrides):
        if not isinstance(store, str | os.PathLike):
            raise ConfigError(f"the store must be a path to a folder written by `moestream pack`, got {store!r}")
        if config is not None and not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        cfg = (config or EngineConfig()).with_overrides(**overrides)
        device = cfg.device or default_device()
        if device == "cuda" and not torch.cuda.is_available():
            raise MoestreamError("--device cuda was asked for, but no CUDA device is available")
        self.store = open_store(store)
        if cfg.speculation == "mtp":
            _check_mtp_head(self.store)
        dtype = cfg.dtype or ("bfloat16" if device == "cuda" else "float32")
        cfg = dataclasses.replace(cfg, device=device, dtype=dtype, expert=self._precisions(store, cfg.expert))
        self.engine_config, self.device, self.dtype = cfg, torch.device(device), getattr(torch, cfg.dtype)
        self.config = self.store.model  # the model (ModelConfig); engine options are in engine_config
        self.provider = self.ranks = None
        if cfg.gpus > 1:  # the other ranks load their experts while this one loads the model
            from moestream.engine.ranks import Ranks

            self.ranks = Ranks(store, cfg, self.device, self.config.hidden_size, self.config.num_experts_per_tok,
                               self.dtype)
        try:
            self._load(store, cfg)
        except BaseException:
            self.close()
            raise

    def _load(self, store: str, cfg: EngineConfig) -> None:
        cuda = self.device.type == "cuda"
        baseline = torch.cuda.memory_allocated(self.device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model = load_model(self.store, self.device, self.dtype, cfg.ngram_tier, cfg.expert.host_gb * 1e9,
                                mtp_head=cfg.speculation == "mtp")
        if cfg.speculation == "mtp" and not hasattr(self.model, "mtp"):
            raise ConfigError(f"--spec mtp: this store's MTP head does not load (want one layer and "
                              f"{head_class(self.model).marker}); use --spec lookup")
        staged = any(t.host is None for t in ngram_tables(self.model))  # a step's rows read on the host before it
        if cfg.max_drafts and staged:
            raise ConfigError("--spec needs the n-gram tables in host memory (--ngram-tier host): a verify step "
                              "reads several tokens' rows in place")
        # the MTP head keeps one sequence's cache, and a table on disk stages one sequence's rows before each step
        mtp = cfg.speculation == "mtp" and cfg.max_drafts > 0
        self.max_batch = 1 if mtp or staged else cfg.max_batch
        self.gpu_plan = None
        if cfg.gpu_gb is not None:
            strides = [self.store.manifest.layouts[p].stride for p in (cfg.expert.precision, cfg.expert.miss_precision)
                       if p is not None]
            self.gpu_plan = plan_gpu(self.model, cfg, max(strides), self.config.num_experts_per_tok, self.dtype,
                                     self.max_batch)
            cfg = dataclasses.replace(cfg, expert=dataclasses.replace(cfg.expert, pool_gb=self.gpu_plan.pool / 1e9))
            self.engine_config = cfg
        # the batch slots past the first make their decode states as sequences need them: a pool sized from free
        # memory leaves them room
        later = (self.max_batch - 1) * state_bytes(self.model, self.dtype, cfg.max_context) if cuda else 0
        provider = self.ranks.provider if self.ranks else ExpertProvider
        self.provider = provider(self.store, cfg.expert, self.device, self.config.num_experts_per_tok, later)
        for block in self.model.moe_blocks(mtp=True):
            block.provider = self.provider
        self.provider.attach({b.layer_slot: b.gate.weight for b in self.model.moe_blocks()})
        self.spec_stats, self.depth = SpecStats(), Depth(cfg.max_drafts, cfg.drafts)
        self.decoder = Decoder(self.model, self.provider, cfg, self.device, self.dtype, max_rows=1 + cfg.max_drafts,
                               max_batch=self.max_batch, kv_tokens=cfg.kv_limit)
        ahead = self.decoder.step_ahead if self.decoder.static and not staged else None
        self.scheduler = Scheduler(self.decoder, self.max_batch, cfg.prefill_chunk, ahead)
        # the graphs' memory is not in a --gpu-gb plan yet: under one, padded prompts run eagerly (the same bits)
        whole = min(cfg.prefill_chunk, cfg.kv_limit or cfg.prefill_chunk)  # the most rows a padded prompt may take
        self.prefiller = Prefiller(self.model, self.provider, self.decoder, self.device, self.dtype,
                                   cfg.decode_mode == "graph" and cfg.gpu_gb is None, cfg.prefill_sms,
                                   padded_sizes(cfg.prefill_graph_tokens, whole))
        kv = self.decoder.kv
        self.kv_positions = kv.blocks * BLOCK_ROWS if kv is not None and kv.bounded else None  # None: it grows
        self.head = HeadDecoder(self.model, self.provider, cfg, self.device, self.dtype, max_rows=1 + cfg.max_drafts) \
            if cfg.speculation == "mtp" and cfg.max_drafts else None
        self.fused = FusedDrafts(self.decoder, self.head) if self.head is not None else None
        self._tokenizer = self._grammars = None
        if cfg.preload if cfg.preload is not None else cuda:
            from moestream.engine.progress import progress_bar

            with progress_bar("loading experts", self.provider.geometry.num_layers) as advance:
                self.provider.preload(lambda done, total: advance(done))
        self.prefix_cache = None  # made after the warm-up: it keeps nothing of it
        if cfg.warm if cfg.warm is not None else cuda:
            self.warm()
            # what the load made lives as long as the engine: out of the collector's way, so that no request pays
            # for a full pass over it (seen on the H200 as the first request's prefill running ~20% slow)
            gc.collect()
            gc.freeze()
        for table in ngram_tables(self.model):  # the warm-up's rows are not a request's
            table.reset_counts()
        self.spec_stats, self.depth = SpecStats(), Depth(cfg.max_drafts, cfg.drafts)  # nor its drafts
        if cfg.prefix_cache_mb > 0:
            self.prefix_cache = PrefixCache(int(cfg.prefix_cache_mb * 1e6), cfg.prefill_chunk, self.decoder.kv)
        self.peak_gpu_bytes = (torch.cuda.max_memory_allocated(self.device) - baseline) if cuda else None
        if self.gpu_plan is not None and self.peak_gpu_bytes is not None and self.peak_gpu_bytes > cfg.gpu_gb * 1e9:
            self.close()
            raise BudgetError(f"--gpu-gb {cfg.gpu_gb:g}: the load and warm-up peaked at "
                              f"{self.peak_gpu_bytes / 1e9:.2f} GB (planned GB: {self.gpu_plan.parts_gb()}); raise it, "
                              "or lower --prefill-chunk")

    def _precisions(self, path: str, expert):
        """`expert` with its precision resolved (None: the store's, Q4 first), each one the store holds or, for
        Q3/Q2, can build from Q4 on first use."""
        held = self.store.manifest.layouts
        precision = expert.precision or self.store.default_precision
        expert = dataclasses.replace(expert, precision=precision)
        for p in {precision, expert.miss_precision} - {None} - set(held):
            if p in ("q3", "q2") and "q4" in held:
                from moestream.packer.lowbit import ensure_precision

                ensure_precision(path, p)
                self.store = open_store(path)
            self.store.experts_path(p)  # refuses a precision the store lacks, before loading anything
        return expert

    @torch.inference_mode()
    def warm(self) -> None:
        """Load the tokenizer, run once every kernel a request uses (a one-token and a 512-token prompt of random
        ids, their experts computed from a scratch record, so that nothing is fetched or counted) and capture the
        decode and prefill graphs; with every record in the pool, two whole requests too, past the graphs' sizes (they
        fetch nothing; their counts are taken back). The first request then runs as fast as the tenth."""
        from moestream.engine.progress import status

        with status("warming the kernels"):
            self.eos_ids  # noqa: B018 (loads the tokenizer)
            generator = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, self.config.vocab_size, (512,), generator=generator)
            chunk = self.engine_config.prefill_chunk  # under a GPU budget, the largest forward's peak is checked
            longest = torch.randint(0, self.config.vocab_size, (chunk,), generator=generator) \
                if self.gpu_plan is not None and chunk > len(prompt) else prompt
            for ids in dict.fromkeys((prompt[:1], prompt, longest)):
                state = self.model.new_state(self.dtype, self.device)
                ctx = StepContext.eager(0, len(ids), self.device, ExpertStep(scratch=True))
                self.model(ids.to(self.device), state, ctx)
            self.decoder.warm()
            self.prefiller.warm()
            if self.head is not None:
                self.head.warm()
                self.fused.warm()
            if self.provider.pool.resident == self.provider.geometry.num_records:
                # past the padded sizes, as a long prompt runs: row counts of both divisibilities Triton specializes
                longer = torch.randint(0, self.config.vocab_size, (self.prefiller.sizes[-1] + 16,), generator=generator)
                with self.provider.uncounted():
                    for ids in (longer[:-15], longer):
                        self.generate([ids.tolist()], SamplingParams(max_tokens=2, ignore_eos=True))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from moestream.engine.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.store.path)
        return self._tokenizer

    @property
    def grammars(self):
        """The grammar compiler for structured answers (engine/grammar.py), made on first use."""
        if self._grammars is None:
            from moestream.engine.grammar import Grammars

            self._grammars = Grammars(self.tokenizer.tok, self.config.vocab_size)
        return self._grammars

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
        yield from self._steps(self._submit(prompt_ids, params))

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was made for (its config's max_position_embeddings), or None."""
        raw = self.config.raw
        return raw.get("max_position_embeddings") or raw.get("text_config", {}).get("max_position_embeddings")

    def room(self, prompt_tokens: int) -> tuple[int, str] | None:
        """The most tokens a request with a prompt of `prompt_tokens` may ask for, and the limit that sets it (the
        model's context, or a bounded KV cache's positions beside the prompt and any drafts); None: no limit."""
        limits = []
        if (context := self.context_length) is not None:
            limits.append((context - prompt_tokens, f"this model's context is {context} tokens"))
        if (positions := self.kv_positions) is not None:
            limits.append((positions - prompt_tokens - self.engine_config.max_drafts,
                           f"this engine's KV cache holds {positions} positions a sequence (--kv-tokens)"))
        return min(limits, default=None)

    def _submit(self, ids: list[int], params: SamplingParams, cancelled=None) -> Request:
        """Queue a request for `ids` (refused now, in one line, when it is not one this model can answer); its answer
        is cut where the sequence would pass the model's context."""
        params.validate()
        ids = self._checked_ids(ids)
        if (context := self.context_length) is not None:
            if len(ids) >= context:
                raise RequestError(f"the prompt has {len(ids)} tokens; this model's context is {context}")
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, context - len(ids)))
        # the most positions it may fill: its prompt's padded forward's, or its answer's end
        rows = max(self.prefiller.rows(len(ids)), len(ids) + params.max_tokens + self.engine_config.max_drafts)
        if self.kv_positions is not None and rows > self.kv_positions:
            raise RequestError(f"the prompt's {len(ids)} tokens and max_tokens {params.max_tokens} need up to "
                               f"{rows} KV positions; this engine's KV cache holds {self.kv_positions} (--kv-tokens)")
        return self.scheduler.submit(Request(lambda slot: self._open(ids, params, slot), cancelled, tuple(ids),
                                             rows=rows))

    def _open(self, ids: list[int], params: SamplingParams, slot: int) -> gen.Generation:
        """The generation of `ids` on batch slot `slot`'s state, from the deepest cached prefix when there is one."""
        state = self.decoder.new_state(slot)
        if self.head is not None:
            state.draft = self.head.new_state()
        # prompt log probabilities need every prompt row's logits: nothing restored
        cached = self.prefix_cache.restore(ids, state) if self.prefix_cache and params.prompt_logprobs is None else 0
        seq = gen.Sequence(list(ids), params, state)
        seq.timings.cached_tokens = cached
        speculator = None
        if self.engine_config.max_drafts:
            head = HeadDrafts(self.head, state.draft) if self.head is not None else None
            speculator = Speculator(self.depth, self.spec_stats, seq.prompt, head, self.fused)
        constraint = self.grammars.constraint(params.structure) if params.structure is not None else None
        return gen.Generation(self.model, seq, self.eos_ids, self.engine_config.prefill_chunk, self.device,
                              self.prefix_cache.insert if self.prefix_cache else None, speculator, constraint,
                              self.prefiller)

    def step(self) -> None:
        """One engine step (engine/scheduler.py): prompts admitted and prefilled, a token for each running
        sequence; when it fails, every request in flight ends with it. The server's engine thread drives it."""
        try:
            with self.prefiller.stepping(self.scheduler.prompts):
                self.scheduler.step()
        except BaseException:
            self.scheduler.fail_all()
            raise

    def _steps(self, request: Request) -> Iterator[gen.Step]:
        """`request`'s tokens as the scheduler makes them (stepping it); a caller that stops early ends it."""
        try:
            while True:
                while request.steps:
                    yield request.steps.popleft()
                if request.finished:
                    return
                self.step()
        finally:
            self.scheduler.cancel(request)

    def _checked_ids(self, ids) -> list[int]:
        if not isinstance(ids, list | tuple) or not ids:
            raise RequestError("the prompt is empty" if isinstance(ids, list | tuple) else
                               f"a prompt is a string or a list of token ids, got {type(ids).__name__}")
        vocab = self.config.vocab_size
        if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:  # at C speed: ~2 us a token else
            return list(ids)
        for i, t in enumerate(ids):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError(f"prompt token {i} is {t!r}: token ids are integers in [0, {vocab})")
        return [int(t) for t in ids]

    def generate(self, prompts, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Prompts are strings (tokenized raw, no chat template) or lists of token ids; one string or one list of
        ids is one prompt."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompts, str) or (isinstance(prompts, list | tuple) and prompts
                                        and not isinstance(prompts[0], str | list | tuple)):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._complete(ids, params)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self._complete([self.tokenizer.chat(messages)], params or SamplingParams())[0]

    def _complete(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        """Every prompt's answer, decoded together (up to `max_batch` at once) through the streaming path, stop
        strings included."""
        streams = [TextStream(self, ids, params, pieces=False) for ids in prompts]
        try:
            for stream in streams:
                stream.start()
            while not all(stream.done for stream in streams):
                self.step()
                for stream in streams:
                    stream.pieces()
        finally:
            for stream in streams:
                stream.close()
        return [stream.output() for stream in streams]

    def _text(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except MoestreamError:
            return ""

    def stats(self) -> dict:
        steps = {kind: dataclasses.asdict(times) for kind, times in self.scheduler.step_times.items()}
        return self.provider.snapshot() | {"ngram": ngram_stats(ngram_tables(self.model)), "memory": self.memory(),
                                           "speculation": self.spec_stats.as_dict(), "steps": steps}

    def memory(self) -> dict:
        """Bytes of each part the engine keeps on the compute device (of the n-gram tables, a disk tier's staging
        buffer of one step's rows)."""
        pool = self.provider.pool
        state = self.decoder.state
        return {"budget": self.engine_config.gpu_gb and int(self.engine_config.gpu_gb * 1e9),
                "dense": dense_bytes(self.model), "pool": pool.num_slots * pool.stride,
                "ring": pool.ring_slots * pool.stride,
                "decode_state": self._state_bytes() if state is not None else None,
                "kv_cache": self._kv_stats(),
                "activations_estimate": activation_bytes(self.config, self.engine_config.prefill_chunk, self.dtype),
                "ngram_tables": sum(t.staging.numel() for t in ngram_tables(self.model) if t.staging is not None),
                "peak_allocated": self.peak_gpu_bytes}

    def _state_bytes(self) -> int:
        """The slots' recurrent states and row maps, the MTP head's cache and the shared KV pool."""
        state = self.decoder.state
        one = state_bytes(self.model, self.dtype, state.capacity, self.decoder.max_rows, self.head is not None)
        kv = self.decoder.kv
        if kv is None:
            return len(self.decoder.slots) * one
        row = kv_row_bytes(state)
        return len(self.decoder.slots) * (one - state.capacity * row) + kv.blocks * BLOCK_ROWS * row

    def _kv_stats(self) -> dict | None:
        """The paged KV cache: its blocks, those in use, and whether it is bounded (requests wait) or grows."""
        kv = self.decoder.kv
        if kv is None:
            return None
        return {"blocks": kv.blocks, "blocks_in_use": kv.used, "block_positions": BLOCK_ROWS, "bounded": kv.bounded,
                "promised_blocks": self.scheduler.promised}

    def close(self) -> None:
        """Stop the fetch threads and let go of the pool, the pinned host tier and the n-gram tables, so that
        another engine can load in this process (the load froze its objects out of the collector's reach)."""
        if self.provider is None and self.ranks is None:
            return
        for part in (self.provider, self.ranks):  # the provider's fetch threads first, then the other ranks
            if part is not None:
                part.close()
        self.decoder = self.head = self.provider = self.ranks = self.model = self.prefix_cache = None
        self.scheduler = self.prefiller = None  # they hold the decoder, the model and the provider too
        gc.unfreeze()
        gc.collect()
