"""Building a model from a store: the module tree on the meta device, then the dense tensors by name, then
the PLE n-gram tables as row readers over their store files (never loaded whole)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from moestream.errors import StoreError
from moestream.experts.ngram import NgramTable
from moestream.experts.store import Store
from moestream.layers.ple import NgramEmbedding
from moestream.models import model_class

IGNORED_PREFIXES = ("mtp.",)  # kept in the store for speculative decoding; not used by the trunk


def load_model(store: Store, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    cfg = store.model
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    tensors = load_file(store.dense_path, device=str(device))
    state = {}
    for name, t in tensors.items():
        if name.startswith(IGNORED_PREFIXES):
            continue
        state[name] = t.to(dtype) if t.is_floating_point() else t
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    expected = set(model.state_dict())
    if missing := sorted(expected - set(state)):
        raise StoreError(f"{store.path}: tensor {missing[0]} is missing ({len(missing)} missing)")
    if unexpected := sorted(set(state) - expected):
        raise StoreError(f"{store.path}: tensor {unexpected[0]} is not used by the {cfg.model_type} model "
                         "(an unsupported variant?)")
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():  # non-persistent buffers were built on the meta device
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()
    attach_ngram_tables(model, store)
    return model.eval().requires_grad_(False)


def attach_ngram_tables(model: torch.nn.Module, store: Store) -> None:
    """Give each PLE n-gram embedding its row reader (the tables stay on disk, read row by row)."""
    layouts = {n.layer: n for n in store.manifest.ngram}
    for module in model.modules():
        if not isinstance(module, NgramEmbedding):
            continue
        layout = layouts.get(module.layer)
        if layout is None:
            raise StoreError(f"{store.path} has no n-gram table for PLE layer {module.layer}")
        needed = int((module.ngram_heads_offsets + module.ngram_heads_vocab_sizes).max())
        if layout.dim != module.head_dim or layout.rows < needed:
            raise StoreError(f"{store.path}: n-gram table of layer {module.layer} is {layout.rows} x {layout.dim}, "
                             f"the model needs at least {needed} x {module.head_dim}")
        module.table = NgramTable(store.ngram_path(module.layer), layout)
