"""Checksums the packer records, and recognising a store already in the output folder."""

from __future__ import annotations

import json
import os

from moestream.errors import StoreError
from moestream.experts.format import MANIFEST, FileCheck, Manifest, full_sha256, sample_sha256


def file_check(path: str, ui=None) -> FileCheck:
    return FileCheck(os.path.getsize(path), full_sha256(path, ui.advance_check if ui else None), sample_sha256(path))


def existing_store(out: str) -> Manifest | None:
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return Manifest.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{out} holds an unreadable manifest.json ({e}); choose another folder") from None
