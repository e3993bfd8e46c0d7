"""Opening a store: the manifest, its version and checksum, every file's size and checksum, and every field
the manifest declares checked against the model's config and the files.

A store is refused before any inference if it is unfinished, from another format version, truncated or
altered (its manifest included), or if any field disagrees with another; the one-line message names the file
and the field. Files up to `FULL_CHECK_BYTES` are hashed whole at open; larger ones by sampled blocks
(`moestream verify` hashes everything).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from moestream.config import ModelConfig
from moestream.errors import MoestreamError, StoreError
from moestream.experts.format import (
    DENSE_FILE,
    MANIFEST,
    PROGRESS_FILE,
    Manifest,
    ManifestError,
    experts_file,
    full_sha256,
    ngram_file,
    sample_sha256,
)

FULL_CHECK_BYTES = 1 << 30


@dataclass(frozen=True)
class Store:
    path: str
    manifest: Manifest
    model: ModelConfig

    @property
    def dense_path(self) -> str:
        return os.path.join(self.path, DENSE_FILE)

    @property
    def default_precision(self) -> str:
        """The expert precision a run uses unless told: Q4 when the store has it, else the one it holds."""
        held = self.manifest.layouts
        return "q4" if "q4" in held else next(iter(held))

    def experts_path(self, precision: str) -> str:
        if precision not in self.manifest.layouts:
            have = ", ".join(self.manifest.layouts)
            raise StoreError(f"{self.path} has no {precision} experts (it has {have}); pack with --experts")
        return os.path.join(self.path, experts_file(precision))

    def ngram_path(self, layer: int) -> str:
        return os.path.join(self.path, ngram_file(layer))


def _load_manifest(path: str) -> Manifest:
    if not os.path.isdir(path):
        raise StoreError(f"no such store folder: {path}")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        if os.path.isfile(os.path.join(path, PROGRESS_FILE)):
            raise StoreError(f"{path} is an unfinished pack; run `moestream pack` again to complete it")
        if os.path.isfile(os.path.join(path, "config.json")):
            raise StoreError(f"{path} is a checkpoint, not a store; run `moestream pack {path}` first")
        raise StoreError(f"{path} is not a moestream store (no {MANIFEST})")
    try:
        with open(mpath, "rb") as f:
            raw = json.loads(f.read())
    except (ValueError, RecursionError) as e:
        raise StoreError(f"{mpath} is not valid JSON ({_one_line(e)}); pack the checkpoint again") from None
    try:
        return Manifest.from_json(raw)
    except ManifestError as e:
        raise StoreError(f"{mpath}: {e}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def check_files(path: str, manifest: Manifest, full: bool | None = None) -> None:
    for name, check in manifest.files.items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise StoreError(f"{fpath} is missing")
        size = os.path.getsize(fpath)
        if size != check.size:
            raise StoreError(f"{fpath} is {size} bytes, the manifest says {check.size} (truncated or altered)")
        whole = full if full is not None else size <= FULL_CHECK_BYTES
        ok = full_sha256(fpath) == check.sha256 if whole else sample_sha256(fpath) == check.sample_sha256
        if not ok:
            raise StoreError(f"{fpath} fails its checksum (altered or corrupt); pack the checkpoint again")


def open_store(path: str, verify: bool | None = None) -> Store:
    """Open and check a store. `verify`: True hashes every file, False samples, None decides by size."""
    manifest = _load_manifest(path)
    check_files(path, manifest, verify)
    mpath = os.path.join(path, MANIFEST)
    try:
        model = ModelConfig.from_hf(manifest.config)
    except MoestreamError as e:
        raise type(e)(f"{mpath}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:  # a gap in from_hf's checks
        raise StoreError(f"{mpath}: config is malformed ({type(e).__name__}: {_one_line(e)})") from None
    check_model(mpath, manifest, model)
    check_dense(os.path.join(path, DENSE_FILE), manifest.dense_dtype)
    for name in manifest.tokenizer_files:
        if not os.path.isfile(os.path.join(path, name)):
            raise StoreError(f"{mpath}: tokenizer_files lists {name}, which is not in the store")
    return Store(path, manifest, model)


def check_model(mpath: str, manifest: Manifest, model: ModelConfig) -> None:
    """The expert geometry and n-gram tables the manifest declares are the ones its config makes."""
    g = manifest.geometry
    if manifest.model_type != model.model_type:
        raise StoreError(f"{mpath}: model_type is {manifest.model_type!r}, its config makes {model.model_type!r}")
    for name, have, want in (("num_experts", g.num_experts, model.num_experts),
                             ("hidden_size", g.hidden_size, model.hidden_size),
                             ("intermediate_size", g.intermediate_size, model.moe_intermediate_size)):
        if have != want:
            raise StoreError(f"{mpath}: experts.{name} is {have}, the config says {want}")
    trunk, mtp = g.layer_ids[: len(model.moe_layer_ids)], g.layer_ids[len(model.moe_layer_ids):]
    # the MoE decoder layers in order, then MTP layers k as -1 - k, in order
    if trunk != model.moe_layer_ids or list(mtp) != sorted(mtp, reverse=True) or any(i >= 0 for i in mtp):
        raise StoreError(f"{mpath}: experts.layer_ids {list(g.layer_ids)} are not the config's MoE layers "
                         f"{list(model.moe_layer_ids)} followed by MTP layers")
    if {n.layer for n in manifest.ngram} != set(model.ple_layer_ids):
        raise StoreError(f"{mpath}: ngram tables are for layers {sorted(n.layer for n in manifest.ngram)}, the "
                         f"config has PLE layers {list(model.ple_layer_ids)}")
    for n in manifest.ngram:
        dim = model.ple_embed_dim // ((model.ngram_size - 1) * model.heads_per_ngram)
        if n.dim != dim:
            raise StoreError(f"{mpath}: ngram table of layer {n.layer} has dim {n.dim}, the config makes {dim}")


ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def check_dense(path: str, dtype: str) -> None:
    """The dense file is a safetensors file whose floating tensors are all in the manifest's dense dtype."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 1 << 30)))
        floats = {t["dtype"] for name, t in header.items() if name != "__metadata__" and t["dtype"] in ST_DTYPES}
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise StoreError(f"{path} has no readable safetensors header ({_one_line(e)})") from None
    if bad := sorted(ST_DTYPES[d] for d in floats if ST_DTYPES[d] != dtype):
        raise StoreError(f"{path} holds {bad[0]} tensors, the manifest's dense.dtype is {dtype}")
