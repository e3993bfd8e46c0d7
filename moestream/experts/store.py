"""Opening a store: the manifest, its version, and every file's size and checksum.

A store is refused before any inference if it is unfinished, from another format version,
truncated or altered; the message names the file. Files up to `FULL_CHECK_BYTES` are hashed whole
at open; larger ones by sampled blocks (`moestream verify` hashes everything).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from moestream.config import ModelConfig
from moestream.errors import MoestreamError, StoreError
from moestream.experts.format import (
    DENSE_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS_FILE,
    Manifest,
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
        with open(mpath) as f:
            raw = json.load(f)
        if raw.get("format") != FORMAT_NAME:
            raise StoreError(f"{mpath} is not a moestream manifest")
        if raw.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{path} is store format version {raw.get('format_version')}, this moestream reads "
                             f"version {FORMAT_VERSION}; pack the checkpoint again")
        return Manifest.from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{mpath} is corrupt ({type(e).__name__}: {e})") from None


def check_files(path: str, manifest: Manifest, full: bool | None = None) -> None:
    expected = [DENSE_FILE, *map(experts_file, manifest.layouts), *(ngram_file(n.layer) for n in manifest.ngram)]
    for name in expected:
        if name not in manifest.files:
            raise StoreError(f"{path}: manifest lists no checksum for {name}")
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
    try:
        model = ModelConfig.from_hf(manifest.config)
    except MoestreamError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path}: manifest config is incomplete ({e})") from None
    return Store(path, manifest, model)
