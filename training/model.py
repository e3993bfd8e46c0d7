"""The demo model: a small `qwen3_moe` trunk that transformers loads unchanged, plus one MTP module.

Contract: `model_config(vocab)` gives the shipped geometry; `build(config)` gives (trunk, mtp);
`joint_forward` gives both heads' logits and the router logits; `save_with_mtp` writes a folder
that transformers loads (the `mtp.*` tensors are ignored as unexpected keys) and `moestream pack`
packs (MTP experts become one extra record layer, layer id -1).

The MTP layout is the one Qwen3-Next checkpoints use, as read in vLLM's
`vllm/model_executor/models/qwen3_next_mtp.py` (also LightLLM's `qwen3next_mtp`):
    mtp.pre_fc_norm_embedding.weight  [H]     RMSNorm of embed(x[t+1]) (the trunk's embed_tokens)
    mtp.pre_fc_norm_hidden.weight     [H]     RMSNorm of h[t], the trunk's final, post-norm hidden state
    mtp.fc.weight                     [H, 2H] no bias, applied to concat(embedding, hidden): embedding first
    mtp.layers.0.*                            one full-attention decoder layer with its own router
                                              (`mlp.gate.weight`) and experts (`mlp.experts.{e}.{gate,up,down}_proj`)
    mtp.norm.weight                   [H]     final RMSNorm; the trunk's lm_head then predicts x[t+2]
Config: `mtp_num_hidden_layers: 1` (Qwen3-Next's key; moestream's ModelConfig reads it). Qwen3-Next's norms
are zero-centred (1 + w) like the rest of that model; ours are qwen3_moe's plain RMSNorm (w * x), as the trunk.
The MTP layer sits at positions 0..T-1 like the trunk (position t for the pair (x[t+1], h[t])).
"""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRMSNorm

SHIPPED = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               intermediate_size=512, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)  # tests


def model_config(vocab_size: int = 4096, **overrides) -> Qwen3MoeConfig:
    """The shipped geometry (`store_bytes` ~20 MB at Q4); overrides make tiny test models."""
    kwargs = dict(SHIPPED, vocab_size=vocab_size, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, norm_topk_prob=True,
                  tie_word_embeddings=False, eos_token_id=[1, 0], pad_token_id=None, router_aux_loss_coef=0.01,
                  mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    kwargs.update(overrides)  # no pad id: nn.Embedding would freeze that row, and <|endoftext|> (0) separates documents
    return Qwen3MoeConfig(**kwargs)


def store_bytes(config: Qwen3MoeConfig) -> dict[str, int]:
    """Size of the packed Q4 store: experts as Q4 records (page-strided), every other tensor bf16."""
    from moestream.experts.format import RecordLayout

    with torch.device("meta"):
        trunk, mtp = build(config)
    dense = sum(p.numel() for n, p in [*trunk.named_parameters(), *mtp.named_parameters()] if ".experts." not in n)
    layers = config.num_hidden_layers + config.mtp_num_hidden_layers
    stride = RecordLayout.build("q4", config.hidden_size, config.moe_intermediate_size).stride
    experts = layers * config.num_experts * stride
    return {"experts": experts, "dense": 2 * dense, "total": experts + 2 * dense}


class MTP(nn.Module):
    """One multi-token-prediction module (names as Qwen3-Next's `mtp.*`, see the module docstring)."""

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.pre_fc_norm_embedding = Qwen3MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # layer_idx only names a KV-cache slot; every qwen3_moe layer with decoder_sparse_step 1 is MoE
        self.layers = nn.ModuleList([Qwen3MoeDecoderLayer(config, config.num_hidden_layers)])
        self.norm = Qwen3MoeRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings, position_ids):
        """hidden: [B, T, H] trunk output (post-norm) at t; next_embeds: [B, T, H] embed(x[t+1]).
        Returns ([B, T, H] hidden for the shared lm_head, [B*T, E] router logits)."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        # the cache goes by position: transformers 5.17 names it past_key_values, later versions cache
        mask = create_causal_mask(self.config, x, None, None, position_ids=position_ids)
        routers: list[torch.Tensor] = []
        hook = self.layers[0].mlp.gate.register_forward_hook(lambda m, i, out: routers.append(out[0]))
        try:
            x = self.layers[0](x, attention_mask=mask, position_ids=position_ids,
                               position_embeddings=position_embeddings)
        finally:
            hook.remove()
        return self.norm(x), routers[0]


BF16_EXPERTS = "bf16_grouped_mm"


def bf16_grouped_experts(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Qwen3MoeExperts' forward with its GEMMs in bf16: grouped_mm's fast path is bf16-only and not
    autocast-aware, so fp32 master weights would take its slow per-expert fallback.
    hidden [N, H], top_k_index/top_k_weights [N, k] -> [N, H]."""
    k = top_k_index.shape[-1]
    flat = top_k_index.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    offs = torch.bincount(flat, minlength=self.num_experts).cumsum(0).to(torch.int32)
    x = hidden[order // k].to(torch.bfloat16)  # [S, H]
    gate, up = F.grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(self.act_fn(gate) * up, self.down_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
    y = y * top_k_weights.flatten()[order, None]  # [S, H]
    return torch.zeros_like(hidden).index_add_(0, order // k, y.to(hidden.dtype))


def use_bf16_experts(trunk: nn.Module) -> None:
    """Route every experts module of this trunk (and its MTP, which shares the config) through
    `bf16_grouped_experts`; the config's `_experts_implementation` is not saved."""
    ALL_EXPERTS_FUNCTIONS.register(BF16_EXPERTS, bf16_grouped_experts)
    trunk.config._experts_implementation = BF16_EXPERTS


def build(config: Qwen3MoeConfig, seed: int | None = None,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, MTP]:
    """A randomly initialised trunk (transformers' init) and MTP module with parameters in `dtype` (buffers
    such as RoPE's stay fp32, as from_pretrained makes them). The MTP shares the trunk's config object, so both
    use the same attention and experts implementations."""
    if seed is not None:
        torch.manual_seed(seed)
    trunk = AutoModelForCausalLM.from_config(config, dtype=dtype)
    mtp = MTP(trunk.config)
    if mtp.fc.weight.device.type != "meta":
        mtp.apply(trunk._init_weights)
    return trunk, mtp.to(dtype)


def joint_forward(trunk: nn.Module, mtp: MTP, tokens: torch.Tensor):
    """tokens: [B, T+1]. Returns (lm logits [B, T, V] for x[1..T], mtp logits [B, T-1, V] for x[2..T],
    router logits: trunk layers then the MTP layer, each [B*T or B*(T-1), E])."""
    inputs = tokens[:, :-1]
    out = trunk.model(input_ids=inputs, output_router_logits=True)
    hidden = out.last_hidden_state  # [B, T, H], post-norm: what the lm_head reads
    logits = trunk.lm_head(hidden)
    t = inputs.shape[1] - 1
    position_ids = torch.arange(t, device=tokens.device)[None]
    position_embeddings = trunk.model.rotary_emb(hidden, position_ids=position_ids)
    next_embeds = trunk.model.embed_tokens(tokens[:, 1:t + 1])
    mtp_hidden, mtp_router = mtp(hidden[:, :t], next_embeds, position_embeddings, position_ids)
    return logits, trunk.lm_head(mtp_hidden), (*out.router_logits, mtp_router)


def mtp_tensors(mtp: MTP) -> dict[str, torch.Tensor]:
    """The MTP state dict under `mtp.`, experts split per expert (the layout save_pretrained writes for the
    trunk and Qwen3-Next checkpoints ship)."""
    out = {}
    for name, t in mtp.state_dict().items():
        t = t.detach().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"mtp.{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"mtp.{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"mtp.{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out["mtp." + name] = t
    return out


def load_mtp_tensors(mtp: MTP, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `mtp_tensors` (a saved folder's `mtp.*` back into the module)."""
    state = {}
    for name, t in mtp.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            base, proj = name.rsplit(".", 1)
            n = t.shape[0]
            if proj == "gate_up_proj":
                parts = [torch.cat([tensors[f"mtp.{base}.{e}.gate_proj.weight"],
                                    tensors[f"mtp.{base}.{e}.up_proj.weight"]]) for e in range(n)]
            else:
                parts = [tensors[f"mtp.{base}.{e}.down_proj.weight"] for e in range(n)]
            state[name] = torch.stack(parts)
        else:
            state[name] = tensors["mtp." + name]
    mtp.load_state_dict(state, strict=True)


def save_with_mtp(trunk: nn.Module, mtp: MTP, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """`save_pretrained` the trunk in `dtype`, then merge the `mtp.*` tensors into its safetensors file
    (a sharded save gets them as one more shard named in the index)."""
    if next(trunk.parameters()).dtype != dtype:  # the copy's RoPE buffer changes too; it is not saved
        trunk = copy.deepcopy(trunk).to(dtype)
    trunk.save_pretrained(path)
    extra = {k: v.to(dtype) if v.is_floating_point() else v for k, v in mtp_tensors(mtp).items()}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
        with open(index) as f:
            meta = json.load(f)
        meta["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        with open(index, "w") as f:
            json.dump(meta, f, indent=2)
        return
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if clash := set(tensors) & set(extra):
        raise ValueError(f"{file} already holds {sorted(clash)[0]}")
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})


if __name__ == "__main__":
    cfg = model_config()
    print(json.dumps({k: v / 1e6 for k, v in store_bytes(cfg).items()}), "MB")
