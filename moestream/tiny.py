"""Tiny random checkpoints of every supported model type, built offline with transformers.

Used by the tests (transformers is the oracle), the demo and the benchmarks. Sizes are multiples
of 64 so that Q4 packing applies. Weights are random: say so wherever their output is shown.
"""

from __future__ import annotations

import json
import os
from typing import Any

_COMMON: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1,
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")  # ids 0, 1, 2; bytes follow
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_HYBRID: dict[str, Any] = dict(
    head_dim=16, shared_expert_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, intermediate_size=128, norm_topk_prob=True)),
    "qwen2_moe": ("qwen2_moe", dict(intermediate_size=128, shared_expert_intermediate_size=64)),
    "qwen3_next": ("qwen3_next", dict(_HYBRID, intermediate_size=128)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_HYBRID)),
    "qwen4_exp": ("qwen4_exp_text", dict(
        _HYBRID, hc_count=2, hc_lowrank=16, ple_layer_ids=[1], ple_embed_dim=64, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    )),
}


def tiny_config(model_type: str, **overrides: Any):
    from transformers import AutoConfig

    hf_type, extra = TINY_CONFIGS[model_type]
    kwargs = {**_COMMON, **extra, **overrides}
    return AutoConfig.for_model(hf_type, **kwargs)


def make_tiny_checkpoint(path: str, model_type: str, seed: int = 0, dtype: str = "bfloat16", words: bool = False,
                         mtp: bool = False, **overrides: Any) -> str:
    """Build a random model from a tiny config and `save_pretrained` it to `path`; with `mtp` (qwen4_exp), a
    random MTP head in its checkpoint layout too."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _randomize(model.named_parameters())
    model.save_pretrained(path)
    make_tiny_tokenizer(path, words)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if mtp:
        _add_qwen4_mtp_head(path, config, getattr(torch, dtype))
        cfg["mtp_num_hidden_layers"] = 1
    if "layer_types" in cfg:  # every transformers 5.x reads "full_attention"; newer ones also write others
        cfg["layer_types"] = ["linear_attention" if t == "linear_attention" else "full_attention"
                              for t in cfg["layer_types"]]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def _randomize(parameters) -> None:
    """Random norms and gates, so that every weight matters."""
    import torch

    with torch.no_grad():
        for name, p in parameters:
            if p.ndim == 1 or "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if "norm" not in name else 0.5))
            elif "ple.conv1d" in name:  # qwen4_exp's PLE conv starts at zero, which would hide it
                p.copy_(torch.randn_like(p) * 0.3)


def _add_qwen4_mtp_head(path: str, config, dtype) -> None:
    """qwen4_exp's `mtp.*` tensors (cherenkov.md §1.1; transformers builds no module for them), made with
    transformers' own layer and mixer: the stem, one attention + MoE layer, the head's mixer."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    if config.model_type != "qwen4_exp_text":
        raise ValueError(f"a tiny MTP head is made for qwen4_exp only, not {config.model_type}")
    attention = next(i for i, kind in enumerate(config.layer_types)
                     if kind != "linear_attention" and i + 1 not in config.ple_layer_ids)
    h = config.hidden_size
    parts = {"layers.0": hf.Qwen4ExpTextDecoderLayer(config, attention),
             "hyper_connection_mixer": hf.Qwen4ExpTextGatedResidual(config, use_combine=False)}
    head = {f"mtp.{part}.{name}": t for part, module in parts.items() for name, t in module.state_dict().items()}
    head |= {"mtp.fc_embedding.weight": torch.empty(h, h), "mtp.fc_hidden.weight": torch.empty(h, h),
             "mtp.pre_fc_norm_embedding.weight": torch.empty(h),
             "mtp.pre_fc_norm_hidden.weight": torch.empty(h * config.hc_count)}
    for t in head.values():
        if t.ndim > 1:
            torch.nn.init.normal_(t, std=config.initializer_range)
    _randomize(head.items())
    file = os.path.join(path, "model.safetensors")
    save_file(load_file(file) | {k: t.to(dtype).contiguous() for k, t in head.items()}, file, {"format": "pt"})


WORDS = (
    "the of and to in is that it for on with as was by at be this from or have an are not but which one all "
    "were can there been has more if will when their who out so what about up into than them some could time "
    "other these may then do first any my now such like our over only new most also after did many before "
    "must through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came right used "
    "take three small large place again home found thought went say part once general high upon school every "
    "does got left number course war until always away something fact though water less public put think "
    "almost hand enough far took head yet government system better set told nothing night end why called "
    "expert pool ring stream disk memory token layer model route cache read write fast slow bytes graph kernel"
).split()


def make_tiny_tokenizer(path: str, words: bool = False) -> None:
    """A byte-level tokenizer (special tokens, then the 256 bytes), or with `words` a word-level one (so a
    random model prints random words rather than broken bytes); both with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    if words:
        vocab.update({w: len(SPECIAL_TOKENS) + i for i, w in enumerate(dict.fromkeys(WORDS + ["<unk>"]))})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    else:
        vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], unk_token="<unk>" if words else None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m moestream.tiny", description="write a tiny random checkpoint")
    p.add_argument("out")
    p.add_argument("--model-type", default="qwen3_moe", choices=sorted(TINY_CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_tiny_checkpoint(args.out, args.model_type, seed=args.seed)
    print(f"wrote a tiny random {args.model_type} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
