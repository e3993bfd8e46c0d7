"""qwen4_exp's MTP head (models/qwen4_exp.py `HyperMTPHead`) against its checkpoint layout computed in
transformers' own layer and mixer (transformers skips `mtp.*`, so the stem is written out here), fp32 on a tiny
random bf16 checkpoint, with bf16 and Q4 experts."""

import pytest
import torch

from moestream.engine.llm import LLM
from tests.models.oracle import assert_logits_close
from tests.models.test_qwen4_exp import prompt
from tests.packer.helpers import source_tensors


@torch.inference_mode()
def reference(checkpoint: str, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The head's logits at positions 0..T-1 from the trunk's streams [T, hc * H] and the tokens after them [T]."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    config = AutoConfig.from_pretrained(checkpoint)
    config._attn_implementation = "eager"
    w = {k: t.float() for k, t in source_tensors(checkpoint).items()}
    experts = "mtp.layers.0.mlp.experts."
    if experts + "0.gate_proj.weight" in w:  # a dequantized oracle names them per expert, as transformers loads them
        per = [[w.pop(f"{experts}{e}.{p}_proj.weight") for p in ("gate", "up", "down")]
               for e in range(config.num_experts)]
        w[experts + "gate_up_proj"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in per])
        w[experts + "down_proj"] = torch.stack([down for _, _, down in per])

    def load(module, prefix):
        module.load_state_dict({k[len(prefix):]: t for k, t in w.items() if k.startswith(prefix)}, strict=True)
        return module.float().eval()

    def norm(x, name):
        return load(hf.Qwen4ExpTextRMSNorm(x.shape[-1], eps=config.rms_norm_eps), f"mtp.{name}.")(x)

    attention = config.layer_types.index("indexed_attention")
    layer = load(hf.Qwen4ExpTextDecoderLayer(config, attention), "mtp.layers.0.")
    mixer = load(hf.Qwen4ExpTextGatedResidual(config, use_combine=False), "mtp.hyper_connection_mixer.")
    rows, h = len(next_ids), config.hidden_size
    embedded = norm(w["model.embed_tokens.weight"][next_ids], "pre_fc_norm_embedding") @ w["mtp.fc_embedding.weight"].T
    fused = norm(streams, "pre_fc_norm_hidden").view(rows, -1, h) @ w["mtp.fc_hidden.weight"].T
    x = (fused + embedded[:, None]).reshape(1, rows, -1)
    positions = torch.arange(rows)[None]
    rope = hf.Qwen4ExpTextRotaryEmbedding(config)(x, positions[None].expand(3, 1, -1))
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=positions, allow_is_causal_skip=False)
    out = layer(x, position_embeddings=rope, attention_mask=mask, conv_mask=None, cache=None)
    return (mixer(out) @ w["lm_head.weight"].T)[0]


@pytest.mark.parametrize("experts", [16, 4])
def test_the_mtp_head_matches_its_layout_in_transformers_layers(tiny, experts):
    store = tiny.store("qwen4_exp", mtp=True)
    oracle = tiny.checkpoint("qwen4_exp", mtp=True) if experts == 16 else tiny.dequantized("qwen4_exp", mtp=True)
    llm = LLM(store, device="cpu", dtype="float32", experts=experts, speculation="mtp")
    try:
        model, ids = llm.model, prompt(60, seed=3)  # past the indexer's budget: its choice shapes the logits
        with torch.inference_mode():
            streams = model(ids, model.new_state(llm.dtype, llm.device))
            got = model.draft_logits(model.draft(streams[:-1], ids[1:], model.mtp.new_state(llm.dtype, llm.device)))
    finally:
        llm.close()
    assert_logits_close(got, reference(oracle, streams[:-1], ids[1:]))
