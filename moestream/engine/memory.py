"""What the engine keeps on the GPU, part by part, and a whole-GPU budget (`gpu_gb`) turned into a pool size.

Parts: the dense weights (counted by storage, so fused projections count once), the decode states (recurrent
states and row maps for `max_context`, one per batch slot, and the paged KV cache's `kv_limit` positions, which
the slots share), the activations of a prefill chunk (an
estimate from the model's dims, checked against the measured peak after the load's warm-up), the prefill ring
and the pool, which gets what is left. The n-gram tables never take GPU memory: the host tier holds them, or the
disk.
"""

from __future__ import annotations

import dataclasses

import torch

from moestream.config import EngineConfig, ModelConfig
from moestream.errors import BudgetError
from moestream.layers.rows import RowCopies
from moestream.models.base import CausalLM

ACTIVATION_FIXED = 512 * 2**20  # QSA's mask chunk, SDPA and allocator slack, whatever the chunk


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def dense_bytes(model: CausalLM) -> int:
    return tensor_bytes(t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta")


def state_bytes(model: CausalLM, dtype: torch.dtype, rows: int, verify_rows: int = 1, head: bool = False) -> int:
    """A decode state reserved for `rows` positions, with per-row copies of its recurrent states for verify steps
    of `verify_rows` rows and, with `head`, the MTP head's cache, sized on the meta device (nothing is allocated)."""
    meta = torch.device("meta")
    states = [model.new_state(dtype, meta)] + ([model.mtp.new_state(dtype, meta)] if head else [])
    for state in states:
        state.reserve(rows)
        if verify_rows > 1:
            state.reserve_rows(verify_rows)
    total = rows * sum(kv_row_bytes(state) for state in states)
    todo = [layer for state in states for layer in state.layers]
    while todo:
        part = todo.pop()
        for value in vars(part).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, RowCopies):
                total += value.bytes()
            elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__") and not isinstance(value, type):
                todo.append(value)
    return total


def kv_row_bytes(state) -> int:
    """Bytes one position takes in a state's attention caches (their keys and values)."""
    return sum(2 * c.k.shape[1] * c.k.shape[2] * c.k.element_size() for c in state.caches)


def slot_bytes(model: CausalLM, dtype: torch.dtype, cfg: EngineConfig, head: bool = False) -> int:
    """A batch slot's decode state without the KV rows the slots share when the KV cache is bounded."""
    one = state_bytes(model, dtype, cfg.max_context, 1 + cfg.max_drafts, head)
    if cfg.kv_limit is None:
        return one
    return one - cfg.max_context * kv_row_bytes(model.new_state(dtype, torch.device("meta")))


def activation_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """A prefill chunk's live activations, estimated: residual streams and their norms, each routed entry's input,
    gate/up and output, the mixers' projections and fp32 recurrent temporaries."""
    width = max(cfg.hc_count, 1) * cfg.hidden_size
    entries = cfg.num_experts_per_tok * (2 * cfg.hidden_size + 2 * cfg.moe_intermediate_size)
    attention = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    deltanet = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + 3 * cfg.linear_num_value_heads * \
        cfg.linear_value_head_dim
    per_token = dtype.itemsize * (8 * width + entries + 2 * max(attention, deltanet)) + 4 * 6 * deltanet
    return tokens * per_token + ACTIVATION_FIXED


FIXED_PARTS = ("dense", "state", "activations", "ring")  # what a budget pays before the pool


@dataclasses.dataclass
class GpuPlan:
    dense: int
    state: int
    activations: int
    ring: int
    pool: int  # what is left for expert records

    def parts_gb(self, names: tuple[str, ...] = (*FIXED_PARTS, "pool")) -> str:
        return ", ".join(f"{name} {getattr(self, name) / 1e9:.2f}" for name in names)


def plan_gpu(model: CausalLM, cfg: EngineConfig, stride: int, top_k: int, dtype: torch.dtype,
             batch: int = 1) -> GpuPlan:
    """Split `cfg.gpu_gb` into parts, with a decode state for each of `batch` sequences; refuses a budget whose
    pool cannot hold one decode step's records."""
    budget = int(cfg.gpu_gb * 1e9)
    kv = cfg.kv_limit * kv_row_bytes(model.new_state(dtype, torch.device("meta")))
    plan = GpuPlan(dense_bytes(model), batch * slot_bytes(model, dtype, cfg, cfg.speculation == "mtp" and
                                                          cfg.max_drafts > 0) + kv,
                   activation_bytes(model.config, cfg.prefill_chunk, dtype), cfg.expert.ring_slots * stride, 0)
    plan.pool = budget - plan.dense - plan.state - plan.activations - plan.ring
    if cfg.expert.pool_gb is not None:
        if cfg.expert.pool_gb * 1e9 > plan.pool:
            raise BudgetError(f"--pool-gb {cfg.expert.pool_gb:g} does not fit in --gpu-gb {cfg.gpu_gb:g} "
                              f"(GB: {plan.parts_gb()})")
        plan.pool = int(cfg.expert.pool_gb * 1e9)
    step = top_k * stride  # one decode step's records
    if plan.pool < step:
        if cfg.expert.pool_gb is not None:
            raise BudgetError(f"--pool-gb {cfg.expert.pool_gb:g} is below one decode step's experts "
                              f"({step / 1e6:.1f} MB)")
        least = sum(getattr(plan, name) for name in FIXED_PARTS) + step
        raise BudgetError(f"--gpu-gb {cfg.gpu_gb:g} is below the {least / 1e9:.2f} GB this model needs with one "
                          f"decode step's experts ({step / 1e6:.1f} MB) in the pool (GB: "
                          f"{plan.parts_gb(FIXED_PARTS)}); raise it, or lower --max-context, --kv-tokens, --max-batch "
                          "or --prefill-chunk")
    return plan
