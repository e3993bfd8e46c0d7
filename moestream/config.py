"""Frozen configuration: the model's geometry from its HF config, and the engine's knobs.

`ModelConfig.from_hf` reads a transformers `config.json` (text config of multimodal models included),
normalises field aliases across versions, and refuses any field that changes the math but that the
engine does not implement. Nothing here touches weights.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from moestream.errors import ConfigError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp")
_TYPE_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen4_exp_text": "qwen4_exp"}
HYBRID_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen4_exp")  # DeltaNet + gated attention


def normalise_model_type(model_type: str | None) -> str:
    mt = _TYPE_ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return mt


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of an HF config (multimodal configs nest it under `text_config`)."""
    if isinstance(hf.get("text_config"), dict):
        merged = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
        merged.update(hf["text_config"])
        merged["model_type"] = hf["text_config"].get("model_type", hf.get("model_type"))
        return merged
    return dict(hf)


_REQUIRED = object()
# beyond any real model: a corrupt count or size is refused, not allocated
MAX_LAYERS, MAX_SIZE = 10_000, 1 << 24


def _shown(value: Any) -> str:
    return text if len(text := repr(value)) <= 60 else text[:57] + "..."


def _as_int(value: Any, name: str, minimum: int | None = 1, maximum: int | None = None) -> int:
    """A JSON integer (not a bool, a float or a string) in [minimum, maximum]."""
    if (isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bounds = {(True, True): f" in [{minimum}, {maximum}]", (True, False): f" >= {minimum}",
                  (False, True): f" <= {maximum}", (False, False): ""}[minimum is not None, maximum is not None]
        raise UnsupportedModelError(f"config field {name} must be an integer{bounds}, got {_shown(value)}")
    return value


def _int(cfg: dict[str, Any], name: str, default: Any = _REQUIRED, minimum: int | None = 1,
         maximum: int | None = MAX_SIZE) -> int:
    """An integer field; absent or null takes `default` (unchecked), or is refused when there is none."""
    if cfg.get(name) is None:
        if default is _REQUIRED:
            raise UnsupportedModelError(f"config field {name} is missing")
        return default
    return _as_int(cfg[name], name, minimum, maximum)


def _ints(cfg: dict[str, Any], name: str, minimum: int | None = 0) -> list[int]:
    """A list of integers; absent or null is empty."""
    if not isinstance(values := cfg.get(name) or [], list):
        raise UnsupportedModelError(f"config field {name} must be a list of integers, got {_shown(values)}")
    return [_as_int(v, name, minimum) for v in values]


def _float(cfg: dict[str, Any], name: str, default: float, maximum: float = math.inf) -> float:
    """A finite number in (0, maximum]; absent or null takes `default`."""
    value = cfg.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= maximum or value == math.inf:
        raise UnsupportedModelError(f"config field {name} must be a finite number in (0, {maximum}], "
                                    f"got {_shown(value)}")
    return float(value)


def _bool(cfg: dict[str, Any], name: str, default: bool) -> bool:
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UnsupportedModelError(f"config field {name} must be true or false, got {_shown(value)}")
    return value


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UnsupportedModelError(f"config field rope_parameters must be an object, got {_shown(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (only default rotary)")
    theta = _float(rope, "rope_theta", _float(cfg, "rope_theta", 10000.0))
    factor = _float(rope, "partial_rotary_factor", _float(cfg, "partial_rotary_factor", 1.0, 1.0), 1.0)
    return {"rope_theta": theta, "partial_rotary_factor": factor}


def _layer_types(cfg: dict[str, Any], mt: str, n: int) -> tuple[str, ...]:
    if mt in ("qwen3_moe", "qwen2_moe"):
        return ("full_attention",) * n
    types = cfg.get("layer_types")
    if types is None:
        interval = _int(cfg, "full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise UnsupportedModelError(f"config field layer_types must be a list of names, got {_shown(types)}")
    if len(types) != n:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
    known = {"linear_attention", "full_attention", "indexed_attention"}
    if bad := sorted(set(types) - known):
        raise UnsupportedModelError(f"unsupported layer_types {bad}")
    if mt != "qwen4_exp" and "indexed_attention" in types:
        raise UnsupportedModelError(f"{mt} has no indexed_attention layers")
    return tuple(types)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]  # per decoder layer: routed experts (True) or a dense MLP
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int  # dense MLP width (mlp_only / non-sparse layers)
    shared_expert_intermediate_size: int  # 0 when the model has no shared expert
    norm_topk_prob: bool
    eos_token_ids: tuple[int, ...]
    linear_num_key_heads: int = 0  # Gated DeltaNet (hybrid models), these five
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    output_gate_type: str = "sigmoid"
    # qwen4_exp: hyper-connections, PLE n-gram embeddings, QSA indexer
    hc_count: int = 1
    hc_lowrank: int = 0
    ple_layer_ids: tuple[int, ...] = ()  # zero-based layer indices
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 0
    ngram_size: int = 0
    heads_per_ngram: int = 0
    indexer_n_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_compress_ratio: int = 0
    mtp_num_hidden_layers: int = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    @property
    def num_record_layers(self) -> int:
        """Expert record layers: every MoE decoder layer, then each MTP layer."""
        return len(self.moe_layer_ids) + self.mtp_num_hidden_layers

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_TYPES

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        if not isinstance(hf, dict):
            raise UnsupportedModelError(f"a model config must be a JSON object, got {_shown(hf)}")
        cfg = text_config(hf)
        mt = normalise_model_type(cfg.get("model_type"))
        n = _int(cfg, "num_hidden_layers", maximum=MAX_LAYERS)
        heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        rope = _rope(cfg)
        experts_key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        num_experts = _int(cfg, experts_key, 0, minimum=0)
        if num_experts <= 0:
            raise UnsupportedModelError(f"{mt} config has no routed experts (num_experts = {num_experts})")
        if _bool(cfg, "use_sliding_window", False):
            raise UnsupportedModelError("use_sliding_window is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        _int(cfg, "max_position_embeddings", None, maximum=None)  # the context limit (LLM.context_length)

        step = _int(cfg, "decoder_sparse_step", 1)
        mlp_only = set(_ints(cfg, "mlp_only_layers"))
        moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(n))
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
        eos_ids = tuple(_as_int(e, "eos_token_id", 0) for e in eos_list)
        shared = _int(cfg, "shared_expert_intermediate_size", 0, minimum=0) if mt != "qwen3_moe" else 0
        attention_bias = _bool(cfg, "attention_bias", False)
        qkv_bias = _bool(cfg, "qkv_bias", True) if mt == "qwen2_moe" else attention_bias
        default_topk_norm = mt in ("qwen3_5_moe", "qwen4_exp")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise UnsupportedModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                        f"{kv_heads}")
        kwargs: dict[str, Any] = dict(
            model_type=mt,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_int(cfg, "head_dim", hidden // heads),
            rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            partial_rotary_factor=rope["partial_rotary_factor"],
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and mt != "qwen2_moe",
            layer_types=_layer_types(cfg, mt, n),
            moe_layers=moe_layers,
            num_experts=num_experts,
            num_experts_per_tok=_int(cfg, "num_experts_per_tok", maximum=num_experts),
            moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
            intermediate_size=_int(cfg, "intermediate_size", 0, minimum=0),
            shared_expert_intermediate_size=shared,
            norm_topk_prob=_bool(cfg, "norm_topk_prob", default_topk_norm) or default_topk_norm,
            eos_token_ids=eos_ids,
            mtp_num_hidden_layers=_int(cfg, "mtp_num_hidden_layers", 0, minimum=0),
            raw=cfg,
        )
        if mt in HYBRID_TYPES:
            kwargs.update(
                linear_num_key_heads=_int(cfg, "linear_num_key_heads"),
                linear_num_value_heads=_int(cfg, "linear_num_value_heads"),
                linear_key_head_dim=_int(cfg, "linear_key_head_dim"),
                linear_value_head_dim=_int(cfg, "linear_value_head_dim"),
                linear_conv_kernel_dim=_int(cfg, "linear_conv_kernel_dim", 4),
                output_gate_type=str(cfg.get("output_gate_type") or "sigmoid"),
            )
            if kwargs["linear_num_value_heads"] % kwargs["linear_num_key_heads"]:
                raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if mt == "qwen4_exp":
            kwargs.update(_qwen4_fields(cfg, hidden, kwargs))
        rotary = int(kwargs["head_dim"] * kwargs["partial_rotary_factor"])
        if kwargs["head_dim"] < 1 or rotary < 2 or rotary % 2:
            raise UnsupportedModelError(f"head_dim {kwargs['head_dim']} x partial_rotary_factor "
                                        f"{kwargs['partial_rotary_factor']} must make an even rotary dim >= 2")
        if not any(moe_layers):
            raise UnsupportedModelError("no decoder layer has routed experts")
        if any(not m for m in moe_layers) and not kwargs["intermediate_size"]:
            raise UnsupportedModelError("dense MLP layers need intermediate_size")
        return cls(**kwargs)


def _qwen4_fields(cfg: dict[str, Any], hidden: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """qwen4_exp's extra fields, checked as transformers checks them; anything the math cannot honour is refused."""
    n, layer_types = kwargs["num_hidden_layers"], kwargs["layer_types"]
    kwargs = {**kwargs, "head_dim": _int(cfg, "head_dim", 256)}  # transformers' default, not hidden / heads
    out: dict[str, Any] = dict(
        head_dim=kwargs["head_dim"],
        hc_count=_int(cfg, "hc_count", 4, minimum=None),
        hc_lowrank=_int(cfg, "hc_lowrank", 320, minimum=None),
        ple_embed_dim=_int(cfg, "ple_embed_dim", hidden),
        ple_conv_kernel_size=_int(cfg, "ple_conv_kernel_size", 4, minimum=None),
        ngram_size=_int(cfg, "ngram_size", 3, minimum=None),
        heads_per_ngram=_int(cfg, "heads_per_ngram", 8, minimum=None),
        norm_topk_prob=_bool(cfg, "norm_topk_prob", True),
        output_gate_type=str(cfg.get("output_gate_type") or cfg.get("hidden_act") or "silu"),
    )
    if out["hc_count"] <= 1:
        raise UnsupportedModelError(f"qwen4_exp needs hc_count > 1, got {out['hc_count']}")
    if out["hc_lowrank"] <= 0:
        raise UnsupportedModelError(f"qwen4_exp needs hc_lowrank > 0, got {out['hc_lowrank']}")
    if out["output_gate_type"] not in ("sigmoid", "silu"):
        raise UnsupportedModelError(f"output_gate_type {out['output_gate_type']!r} is not supported (sigmoid or silu)")
    if cfg.get("mlp_only_layers") or _int(cfg, "decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError("qwen4_exp has routed experts on every layer; mlp_only_layers and "
                                    "decoder_sparse_step are not supported")
    out.update(_ple_fields(cfg, out, n, layer_types, kwargs["eos_token_ids"]))
    out.update(_indexer_fields(cfg, kwargs))
    return out


def _ple_fields(cfg: dict[str, Any], out: dict[str, Any], n: int, layer_types: tuple[str, ...],
                eos: tuple[int, ...]) -> dict[str, Any]:
    ids = sorted(set(_ints(cfg, "ple_layer_ids", None)))
    if not ids:
        return {}
    if bad := [i for i in ids if not 1 <= i <= n]:
        raise UnsupportedModelError(f"ple_layer_ids are one-based layer ids in [1, {n}], got {bad}")
    if bad := [i for i in ids if layer_types[i - 1] != "linear_attention"]:
        raise UnsupportedModelError(f"PLE is only supported on linear_attention layers, got PLE on layers {bad}")
    heads = (out["ngram_size"] - 1) * out["heads_per_ngram"]
    if out["ngram_size"] < 2 or heads <= 0 or out["ple_embed_dim"] % heads:
        raise UnsupportedModelError(f"ple_embed_dim {out['ple_embed_dim']} must split evenly over "
                                    f"(ngram_size - 1) x heads_per_ngram = {heads} > 0 n-gram heads")
    if out["ple_conv_kernel_size"] < 1:
        raise UnsupportedModelError(f"ple_conv_kernel_size must be >= 1, got {out['ple_conv_kernel_size']}")
    if not eos:
        raise UnsupportedModelError("PLE layers need eos_token_id (n-grams restart after it)")
    return dict(ple_layer_ids=tuple(i - 1 for i in ids))  # config ids are one-based


_INDEXER = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def _indexer_fields(cfg: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """With the indexer fields, the "full_attention" layers are QSA indexed; without, plain gated attention."""
    types = kwargs["layer_types"]
    if all(cfg.get(f) is None for f in (*_INDEXER, "indexer_kv_heads")):
        if "indexed_attention" in types:
            raise UnsupportedModelError("indexed_attention layers need the indexer_* config fields")
        return {}
    if missing := [f for f in _INDEXER if cfg.get(f) is None]:
        raise UnsupportedModelError(f"QSA config is missing {', '.join(missing)}")
    values = {f: _int(cfg, f, minimum=None) for f in _INDEXER}
    if any(v <= 0 for v in values.values()):
        raise UnsupportedModelError(f"QSA config values must be positive: {values}")
    if _int(cfg, "indexer_kv_heads", 1, minimum=None) != 1:
        raise UnsupportedModelError("QSA needs indexer_kv_heads = 1")
    if values["indexer_budget"] % values["indexer_compress_ratio"]:
        raise UnsupportedModelError("indexer_budget must be a multiple of indexer_compress_ratio")
    rotary_dim = int(kwargs["head_dim"] * kwargs["partial_rotary_factor"])
    if rotary_dim > values["indexer_head_dim"]:
        raise UnsupportedModelError(f"rotary dim {rotary_dim} does not fit the QSA index head "
                                    f"(indexer_head_dim {values['indexer_head_dim']})")
    return dict(values, layer_types=tuple("indexed_attention" if t == "full_attention" else t for t in types))


# expert precision name -> bits; bf16 records hold the source weights unchanged
PRECISIONS = {"q4": 4, "q3": 3, "q2": 2, "bf16": 16}
DECODE_MODES = ("graph", "eager", "handshake")
NGRAM_TIERS = ("auto", "host", "disk")
SPECULATION = ("off", "lookup", "mtp")
MAX_DRAFTS = 4
MAX_BATCH = 16  # a batched step's rows keep the bits of single steps up to the decode kernels' tile (kernels/ops.py)
MAX_GPUS = 8  # one host's


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass(frozen=True)
class ExpertConfig:
    """How routed experts are kept and streamed (DESIGN.md section 3)."""

    precision: str | None = None  # "q4", "q3", "q2" or "bf16"; None: what the store holds (q4 first)
    miss_precision: str | None = None  # "q3"/"q2" with q4: misses fetched low-bit (--miss-experts)
    pool_gb: float | None = None  # GPU pool budget in decimal GB; None = automatic
    host_gb: float = 0.0  # pinned host-RAM tier; 0 = off
    ring_slots: int = 64  # prefill ring (Cherenkov: 64)
    ring_group: int = 16  # experts per ring batch (Cherenkov: 8; 16 fills the H200's SMs with a batch's launches)
    lookahead: bool = True  # prefetch layer L+1's predicted experts during layer L
    ring_lookahead: bool = True  # prefill: the next layer's ring fetches start early (v7, 16 a batch: 90% of bound)
    prefill_min_rows: int = 32  # a layer step with this many rows streams its misses through the ring
    read_threads: int = 8
    staging_records: int = 16  # pinned staging buffers when there is no host tier
    direct_io: bool = True
    fake_reads: bool = False  # benchmarks: skip disk reads and copies to time the GPU path alone (slots hold garbage)
    io_timeout_s: float = 30.0
    profile: bool = False  # benchmarks: CUDA events per prefill layer (copy, compute and wall time) in the stats

    def __post_init__(self):
        _check(self.precision in (None, *PRECISIONS), f"expert precision {self.precision!r}: choose 4, 3, 2 or 16")
        _check(self.miss_precision is None or self.miss_precision in ("q3", "q2") and self.precision in (None, "q4"),
               "--miss-experts takes 3 or 2, with --experts 4")
        _check(_finite(self.pool_gb) and (self.pool_gb is None or self.pool_gb > 0), "--pool-gb must be a number > 0")
        _check(_finite(self.host_gb) and self.host_gb >= 0, "--host-gb must be a number >= 0 (0: no host tier)")
        _check(self.ring_slots >= 1 and self.ring_group >= 1, "need --ring >= 1 and --group >= 1")
        _check(self.prefill_min_rows >= 1 and self.read_threads >= 1 and self.staging_records >= 1,
               "prefill_min_rows, read_threads and staging_records must be >= 1")
        _check(_finite(self.io_timeout_s) and self.io_timeout_s > 0, "io_timeout_s must be a number > 0")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, checked when made: `LLM(store, EngineConfig(...), **overrides)`."""

    device: str | None = None  # "cuda" or "cpu"; None: cuda when a GPU is present
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    expert: ExpertConfig = field(default_factory=ExpertConfig)
    # GPU memory the engine may take (decimal GB) for dense weights, decode state, activations, ring and the expert
    # pool, which gets the rest (engine/memory.py); None: the pool is sized from free memory
    gpu_gb: float | None = None
    # decode steps: "graph" (captured once every record is addressable), "eager" (the same static step, never
    # captured: to time graphs against) or "handshake" (every layer routed through the host: invariance tests)
    decode_mode: str = "graph"
    max_context: int = 8192  # positions a decode state's row maps cover at load (grown by doubling past it)
    # positions the paged KV cache holds across running sequences (layers/kv.py): a sequence is admitted when the
    # blocks its prompt and max_tokens may fill are free; None: 2 * max_context under --gpu-gb, else it grows
    kv_tokens: int | None = None
    prefill_chunk: int = 4096  # prompt tokens per forward; prefix-cache snapshots are taken at its multiples
    prefill_graph_tokens: int = 512  # whole prompts up to it run padded, as CUDA graphs if resident (engine/prefill.py)
    prefix_cache_mb: float = 0.0  # host memory for prompt-prefix snapshots; 0 = off
    preload: bool | None = None  # load every record at start when the pool or host tier holds them; None: on CUDA
    warm: bool | None = None  # compile every kernel variant and capture the decode graph at load; None: on CUDA
    # PLE n-gram tables: "host" (read whole into pinned memory; decode graphs read rows in place), "disk" (rows
    # read per token; decode eager), "auto" (host when the machine has the memory free beyond the host tier)
    ngram_tier: str = "auto"
    # speculative decoding: drafts from "lookup" (n-grams of the prompt and output) or "mtp" (the checkpoint's MTP
    # head), verified k+1 rows a step; `drafts` fixes k (0..MAX_DRAFTS), None chooses it per step
    speculation: str = "off"
    drafts: int | None = None
    # sequences decoded together (continuous batching; engine/scheduler.py): each holds a decode state (recurrent
    # states, row maps) once it runs and KV blocks as it fills them; 1 with MTP drafts, or a PLE table on disk
    max_batch: int = 16
    prefill_sms: int | str = 0  # SMs a prompt takes while others decode (engine/prefill.py); 0: all; or "auto"
    # GPUs of one host the experts are spread over (engine/ranks.py): each holds expert e of every layer where
    # e % gpus is its rank, with the pool and host-tier budgets given per GPU; on the CPU, processes (tests)
    gpus: int = 1

    def __post_init__(self):
        _check(self.device in (None, "cuda", "cpu"), f"device {self.device!r}: choose cuda or cpu")
        _check(self.dtype in (None, "bfloat16", "float16", "float32"),
               f"dtype {self.dtype!r}: choose bfloat16, float16 or float32")
        _check(self.decode_mode in DECODE_MODES, f"decode_mode {self.decode_mode!r}: choose {', '.join(DECODE_MODES)}")
        _check(self.max_context >= 1 and self.prefill_chunk >= 1, "need max_context >= 1 and prefill_chunk >= 1")
        _check(isinstance(self.prefill_graph_tokens, int) and self.prefill_graph_tokens >= 512
               and self.prefill_graph_tokens % 512 == 0, "--prefill-graph-tokens: choose a multiple of 512")
        _check(self.kv_tokens is None or (isinstance(self.kv_tokens, int) and self.kv_tokens >= 1),
               f"--kv-tokens {self.kv_tokens!r}: choose a whole number >= 1")
        _check(_finite(self.prefix_cache_mb) and self.prefix_cache_mb >= 0, "prefix_cache_mb must be a number >= 0")
        _check(_finite(self.gpu_gb) and (self.gpu_gb is None or self.gpu_gb > 0), "--gpu-gb must be a number > 0")
        _check(self.ngram_tier in NGRAM_TIERS, f"ngram_tier {self.ngram_tier!r}: choose {', '.join(NGRAM_TIERS)}")
        _check(self.speculation in SPECULATION, f"speculation {self.speculation!r}: choose {', '.join(SPECULATION)}")
        _check(isinstance(self.max_batch, int) and 1 <= self.max_batch <= MAX_BATCH,
               f"--max-batch {self.max_batch!r}: choose 1..{MAX_BATCH}")
        _check(self.prefill_sms == "auto" or isinstance(self.prefill_sms, int) and self.prefill_sms >= 0,
               "--prefill-sms: choose a number >= 0 or auto")
        _check(isinstance(self.gpus, int) and 1 <= self.gpus <= MAX_GPUS, f"--gpus {self.gpus!r}: choose 1..{MAX_GPUS}")
        _check(self.gpus == 1 or self.gpu_gb is None,
               "--gpu-gb plans one GPU's memory; with --gpus give each GPU's --pool-gb (and --host-gb)")
        _check(self.drafts is None or (isinstance(self.drafts, int) and 0 <= self.drafts <= MAX_DRAFTS),
               f"--drafts {self.drafts!r}: choose 0..{MAX_DRAFTS}")

    @property
    def max_drafts(self) -> int:
        """The most drafts a verify step checks (0: no speculation)."""
        if self.speculation == "off":
            return 0
        return MAX_DRAFTS if self.drafts is None else self.drafts

    @property
    def kv_limit(self) -> int | None:
        """Positions the KV cache may hold, or None where it grows as sequences need."""
        if self.kv_tokens is not None:
            return self.kv_tokens
        return 2 * self.max_context if self.gpu_gb is not None else None

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """This config with fields replaced by name; ExpertConfig's fields may be named directly, and `experts` /
        `miss_experts` take bits (4, 3, 2, 16) as the command line does."""
        names = {f.name for f in dataclasses.fields(ExpertConfig)}
        expert = {k: overrides.pop(k) for k in list(overrides) if k in names}
        for name, target in (("experts", "precision"), ("miss_experts", "miss_precision")):
            if name in overrides:
                expert[target] = _precision(overrides.pop(name))
        if unknown := sorted(set(overrides) - {f.name for f in dataclasses.fields(self)}):
            raise ConfigError(f"unknown engine option {unknown[0]!r}")
        return dataclasses.replace(self, expert=dataclasses.replace(self.expert, **expert), **overrides)


def precision_name(bits: int) -> str:
    for name, b in PRECISIONS.items():
        if b == bits:
            return name
    raise ValueError(f"no expert precision with {bits} bits; choose from 4, 3, 2 or 16")


def _precision(bits: int | str | None) -> str | None:
    if bits is None or bits in PRECISIONS:
        return bits
    try:
        return precision_name(bits)
    except ValueError as e:
        raise ConfigError(str(e)) from None
