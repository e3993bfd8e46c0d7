"""Packing streams tensor by tensor: peak RSS grows by far less than the checkpoint's size."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

from moestream.tiny import tiny_config

PROBE = """
import sys
from moestream.packer.pack import PackOptions, pack

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

base = status("VmRSS:")
pack(sys.argv[1], sys.argv[2], PackOptions(show_progress=False))
print(base, status("VmHWM:"))
"""


def _big_checkpoint(path, layers=8, experts=40, hidden=1024, inter=512) -> int:
    """A qwen3_moe checkpoint of about 1 GB, written one layer per shard."""
    os.makedirs(path)
    cfg = tiny_config("qwen3_moe", hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    total, weight_map = 0, {}

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    for layer in range(layers + 1):
        if layer == layers:
            t = {"model.embed_tokens.weight": rand(cfg.vocab_size, hidden), "model.norm.weight": rand(hidden),
                 "lm_head.weight": rand(cfg.vocab_size, hidden)}
        else:
            p = f"model.layers.{layer}."
            t = {p + "input_layernorm.weight": rand(hidden), p + "post_attention_layernorm.weight": rand(hidden),
                 p + "self_attn.q_proj.weight": rand(1024, hidden), p + "self_attn.k_proj.weight": rand(512, hidden),
                 p + "self_attn.v_proj.weight": rand(512, hidden), p + "self_attn.o_proj.weight": rand(hidden, 1024),
                 p + "self_attn.q_norm.weight": rand(128), p + "self_attn.k_norm.weight": rand(128),
                 p + "mlp.gate.weight": rand(experts, hidden)}
            for e in range(experts):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
        name = f"model-{layer:05d}.safetensors"
        save_file(t, os.path.join(path, name))
        weight_map.update({k: name for k in t})
        total += sum(v.numel() * 2 for v in t.values())
        del t
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def test_pack_memory_is_bounded(tmp_path):
    size = _big_checkpoint(str(tmp_path / "big"))
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "big"), str(tmp_path / "store")],
                         capture_output=True, text=True, check=True)
    base, peak = map(int, out.stdout.split())
    grew = peak - base
    print(f"checkpoint {size / 1e9:.2f} GB; RSS {base / 1e6:.0f} MB before packing, peak {peak / 1e6:.0f} MB: "
          f"grew by {grew / 1e6:.0f} MB ({grew / size:.1%} of the checkpoint)")
    assert size > 0.9e9
    assert grew < 0.15 * size
