"""Building a model from a store: the module tree on the meta device, then the dense tensors by name, then
the PLE n-gram tables, in host memory or read from their store files row by row (never on the GPU)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from moestream.errors import StoreError
from moestream.experts.ngram import NgramTable
from moestream.experts.store import Store
from moestream.layers.ple import NgramEmbedding
from moestream.models import model_class
from moestream.models.mtp import head_class


def load_model(store: Store, device: torch.device, dtype: torch.dtype, ngram_tier: str = "auto",
               host_reserved: float = 0.0, mtp_head: bool = False) -> torch.nn.Module:
    """`mtp_head`: build and load the store's MTP head too (`model.mtp`), where it has one in a layout we run."""
    cfg = store.model
    tensors = load_file(store.dense_path, device=str(device))
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
        head = head_class(model)
        mtp = mtp_head and cfg.mtp_num_hidden_layers == 1 and head.marker in tensors
        if mtp:
            model.mtp = head(cfg, model.spec)
    state = {}
    for name in list(tensors):  # popped as converted, so a tensor and its converted copy are not both kept
        t = tensors.pop(name)
        if name.startswith("mtp.") and not mtp:  # a head this engine does not draft with stays on the disk
            continue
        state[name] = t.to(dtype) if t.is_floating_point() else t
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    expected = model.state_dict()  # meta tensors: the names and shapes the config makes
    if missing := sorted(set(expected) - set(state)):
        raise StoreError(f"{store.path}: tensor {missing[0]} is missing ({len(missing)} missing)")
    if unexpected := sorted(set(state) - set(expected)):
        raise StoreError(f"{store.path}: tensor {unexpected[0]} is not used by the {cfg.model_type} model "
                         "(an unsupported variant?)")
    if wrong := [n for n in sorted(state) if state[n].shape != expected[n].shape]:
        raise StoreError(f"{store.path}: tensor {wrong[0]} is {list(state[wrong[0]].shape)}, the config makes it "
                         f"{list(expected[wrong[0]].shape)} (the manifest's config and dense.safetensors disagree)")
    model.load_state_dict(state, strict=True, assign=True)
    del state  # the model's parameters only: fusing a module's projections then frees their unfused copies
    for module in model.modules():  # non-persistent buffers were built on the meta device
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()
    attach_ngram_tables(model, store, device, ngram_tier, host_reserved)
    return model.eval().requires_grad_(False)


def attach_ngram_tables(model: torch.nn.Module, store: Store, device: torch.device, tier: str = "auto",
                        host_reserved: float = 0.0) -> None:
    """Give each PLE n-gram embedding its table: read whole into (pinned) host memory, where decode graphs read
    its rows in place, or left on disk and read row by row (a decode step's through a small staging buffer).
    "auto" takes the host when the tables fit in the memory the machine has free beyond `host_reserved` bytes
    (the expert host tier's budget)."""
    layouts = {n.layer: n for n in store.manifest.ngram}
    embeddings = [m for m in model.modules() if isinstance(m, NgramEmbedding)]
    for module in embeddings:
        layout = layouts.get(module.layer)
        if layout is None:
            raise StoreError(f"{store.path} has no n-gram table for PLE layer {module.layer}")
        needed = int((module.ngram_heads_offsets + module.ngram_heads_vocab_sizes).max())
        if layout.dim != module.head_dim or layout.rows < needed:
            raise StoreError(f"{store.path}: n-gram table of layer {module.layer} is {layout.rows} x {layout.dim}, "
                             f"the model needs at least {needed} x {module.head_dim}")
        module.table = NgramTable(store.ngram_path(module.layer), layout)
    total = sum(m.table.nbytes for m in embeddings)
    if not total or tier == "disk" or (tier == "auto" and total > free_host_bytes() - host_reserved):
        for module in embeddings:
            module.table.make_staging(module.ngram_heads_offsets.numel(), device)
        return
    from moestream.engine.progress import progress_bar

    with progress_bar("loading n-gram tables (MB)", total // 10**6) as advance:
        done = 0
        for module in embeddings:
            module.table.load_host(device, lambda n, before=done: advance((before + n) // 10**6))
            done += module.table.nbytes


def ngram_tables(model: torch.nn.Module) -> list[NgramTable]:
    return [m.table for m in model.modules() if isinstance(m, NgramEmbedding)]


def ngram_stats(tables: list[NgramTable]) -> dict:
    """Where the tables are and the rows read per tier (stats()["ngram"])."""
    out = {"tier": "host" if tables and tables[0].host is not None else "disk" if tables else None,
           "table_bytes": sum(t.nbytes for t in tables), "reads": {}}
    for t in tables:
        for tier, c in t.counts().items():
            mine = out["reads"].setdefault(tier, {"rows": 0, "bytes": 0})
            mine["rows"] += c["rows"]
            mine["bytes"] += c["bytes"]
    return out


def free_host_bytes() -> int:
    """Memory the machine has available (Linux MemAvailable; elsewhere, its free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
