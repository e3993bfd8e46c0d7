"""`moestream pack`: stream a checkpoint into a store, resumably, and write the manifest last.

Order of work: a progress file first (finished layers and the dense file; a pack killed at any point resumes
where it stopped and ends byte for byte like an uninterrupted one), expert records layer by layer, the dense
file, the n-gram tables and the tokenizer; then a re-read of sampled records and tensors against the source,
the checksums, and finally the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from moestream.errors import SourceError, StoreError
from moestream.experts.format import (
    DENSE_FILE,
    MANIFEST,
    PROGRESS_FILE,
    ExpertGeometry,
    Manifest,
    RecordLayout,
    experts_file,
    ngram_file,
)
from moestream.packer import checks
from moestream.packer.dense import dense_names, write_dense, write_ngram_tables
from moestream.packer.names import ExpertPlan, plan_experts
from moestream.packer.progress import PackProgress
from moestream.packer.records import encode_all
from moestream.packer.sources import CheckpointSource, open_source
from moestream.packer.verify import verify_samples

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
                   "tokenizer.model")


@dataclass(frozen=True)
class PackOptions:
    precisions: tuple[str, ...] = ("q4",)
    dense_dtype: torch.dtype = torch.bfloat16
    verify_samples: int = 8
    show_progress: bool = True


def _fingerprint(src: CheckpointSource, opts: PackOptions) -> dict:
    files = sorted({info.path for info in src.tensors.values()})
    return {
        "source": os.path.abspath(src.path),
        "files": {os.path.basename(f): os.path.getsize(f) for f in files},
        "precisions": sorted(opts.precisions),
        "dense_dtype": str(opts.dense_dtype),
    }


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prepare_output(out: str, fingerprint: dict) -> dict:
    """Create or reuse the output folder; returns the progress record, written before anything else so that a
    pack killed at any later point is recognised as unfinished."""
    os.makedirs(out, exist_ok=True)
    progress_path = os.path.join(out, PROGRESS_FILE)
    if os.path.isfile(progress_path):
        try:
            with open(progress_path) as f:
                progress = json.load(f)
        except (OSError, ValueError) as e:
            raise StoreError(f"{progress_path} is unreadable ({e}); remove {out} and pack again") from None
        if progress.get("fingerprint") == fingerprint:
            return progress
        raise StoreError(f"{out} holds an unfinished pack of another source or options "
                         f"({progress.get('fingerprint', {}).get('source')}); choose another folder or remove it")
    # a pack killed while writing its first progress record leaves only that record's temporary file
    if set(os.listdir(out)) - {PROGRESS_FILE + ".tmp"}:
        raise StoreError(f"{out} is not empty and holds no unfinished pack of this source; "
                         "choose an empty folder")
    progress = {"fingerprint": fingerprint, "layers_done": [], "dense_done": False}
    _write_json_atomic(progress_path, progress)
    return progress


def _check_mlx_experts(src: CheckpointSource, plan: ExpertPlan) -> None:
    for ref in {r.name for r in plan.refs.values()}:
        bits, group = src.quant_params(ref[: -len(".weight")])
        if (bits, group) != (4, 64):
            raise SourceError(f"{ref}: MLX experts are {bits}-bit with group size {group}; moestream packs "
                              "MLX experts bit for bit only at 4 bits, group size 64")


def pack(src_path: str, out: str, opts: PackOptions = PackOptions()) -> Manifest:
    src = open_source(src_path)
    cfg = src.model
    names = sorted(src.tensors)
    plan = plan_experts(names, {n: src.tensors[n].shape for n in names}, cfg)
    if plan.mlx:
        if "bf16" in opts.precisions:
            raise SourceError("--experts 16 needs a bf16/fp16/fp32 source; an MLX 4-bit checkpoint packs as Q4")
        _check_mlx_experts(src, plan)
    existing = checks.existing_store(out)
    fingerprint = _fingerprint(src, opts)
    if existing is not None:
        if existing.source.get("fingerprint") == fingerprint:
            # a pack killed between writing its manifest and removing its progress file
            if os.path.isfile(progress := os.path.join(out, PROGRESS_FILE)):
                os.remove(progress)
            return existing
        raise StoreError(f"{out} already holds a different store ({existing.model_type} from "
                         f"{existing.source.get('path')}); choose another folder or remove it")
    progress = _prepare_output(out, fingerprint)
    geometry = ExpertGeometry(len(plan.layer_ids), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                              plan.layer_ids)
    try:
        layouts = {p: RecordLayout.build(p, cfg.hidden_size, cfg.moe_intermediate_size) for p in opts.precisions}
    except ValueError as e:
        raise SourceError(str(e)) from None
    dense = dense_names(src, plan)
    ui = PackProgress(src, geometry, layouts, dense, enabled=opts.show_progress)
    with ui:
        _write_experts(src, plan, geometry, layouts, out, progress, ui)
        if not progress["dense_done"]:
            write_dense(src, dense, os.path.join(out, DENSE_FILE), opts.dense_dtype, ui)
            progress["dense_done"] = True
            _write_json_atomic(os.path.join(out, PROGRESS_FILE), progress)
        ngram = write_ngram_tables(src, out, ui)
        tokenizer = _copy_tokenizer(src_path, out)
        ui.phase("verifying")
        verify_samples(src, plan, layouts, dense, out, opts)
        files = [experts_file(p) for p in layouts] + [DENSE_FILE] + [ngram_file(n.layer) for n in ngram]
        ui.start_checksums(sum(os.path.getsize(os.path.join(out, f)) for f in files))
        file_checks = {f: checks.file_check(os.path.join(out, f), ui) for f in files}
    manifest = Manifest(
        model_type=cfg.model_type, config=src.config,
        source={"kind": src.kind, "path": os.path.abspath(src_path), "fingerprint": fingerprint},
        dense_dtype=str(opts.dense_dtype).removeprefix("torch."), geometry=geometry, layouts=layouts,
        ngram=tuple(ngram), tokenizer_files=tuple(tokenizer), files=file_checks,
    )
    _write_json_atomic(os.path.join(out, MANIFEST), manifest.to_json())
    os.remove(os.path.join(out, PROGRESS_FILE))
    return manifest


def _write_experts(src, plan, geometry, layouts, out, progress, ui) -> None:
    fds = {}
    try:
        for p, layout in layouts.items():
            path = os.path.join(out, experts_file(p))
            fds[p] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fds[p], geometry.num_records * layout.stride)
        for slot in range(geometry.num_layers):
            if slot in progress["layers_done"]:
                ui.skip_layer()
                continue
            for e in range(geometry.num_experts):
                rid = geometry.rid(slot, e)
                for p, record in encode_all(src, plan, layouts, slot, e).items():
                    os.pwrite(fds[p], record.numpy().tobytes(), rid * layouts[p].stride)
                    ui.advance(layouts[p].stride)
            for fd in fds.values():
                os.fsync(fd)
            progress["layers_done"].append(slot)
            _write_json_atomic(os.path.join(out, PROGRESS_FILE), progress)
    finally:
        for fd in fds.values():
            os.close(fd)


def _copy_tokenizer(src_path: str, out: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES + ("config.json",):
        path = os.path.join(src_path, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out, name))
            copied.append(name)
    return copied
