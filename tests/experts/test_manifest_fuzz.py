"""An edited manifest is refused in one line, or it changes nothing (issue 27).

The fuzz edits a tiny store's manifest at random: numbers, types, deleted and added keys, swapped values,
nested config fields, broken JSON. Half the edits keep the stale checksum (refused as edited after pack), half
reseal it, so that the field checks themselves meet every edit. Opening the edited store must raise a
moestream error with a one-line message, or open; an opened store is loaded and must give the unedited
store's logits and greedy tokens bit for bit, unless a resealed edit changed the model's config (a forged but
consistent model, which runs).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from collections import Counter

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.errors import MoestreamError, StoreError
from moestream.experts.format import MANIFEST, MANIFEST_SHA256, Manifest, manifest_digest, sealed, write_manifest
from moestream.experts.store import open_store

PROMPT = [5, 17, 42, 7, 99]
EDITS = {"qwen3_moe": 300, "qwen4_exp": 100}
NUMBER_EDITS = (lambda v: v + 1, lambda v: v - 1, lambda v: 0, lambda v: -v, lambda v: v * 2, lambda v: 1 << 40,
                lambda v: v + 0.5, lambda v: float(v))
ODD_VALUES = ("4", "", None, True, False, [], {}, 1.5, -1, 0, "bf16", [1, 2], {"a": 1})


def run(store: str) -> tuple[torch.Tensor, list[int]]:
    llm = LLM(store, device="cpu")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0))[0]
    return llm.logits(PROMPT), out.token_ids


def positions(node, prefix=()):
    """Every position in a JSON tree, as its path of keys and indices (the root is `()`)."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from positions(child, prefix + (key,))


def edit(doc: dict, rng: random.Random) -> str:
    """Apply one random edit to `doc` in place; returns what it did."""
    region = rng.choice(["config", "config", "experts", "files", "ngram", "dense", "top", "any"])
    paths = [p for p in positions(doc) if p and (region == "any" or region == "top" and len(p) == 1 or p[0] == region)]
    path = rng.choice(paths or [p for p in positions(doc) if p])
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    op = rng.choice(["number", "number", "retype", "delete", "add", "swap", "same"])
    if op == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        parent[key] = rng.choice(NUMBER_EDITS)(value)
    elif op == "delete":
        del parent[key]
    elif op == "add" and isinstance(value, dict):
        value["unexpected"] = 1
    elif op == "add" and isinstance(value, list):
        value.append(copy.deepcopy(value[-1]) if value else 0)
    elif op == "swap" and len(parent) > 1:
        other = rng.choice([k for k in (parent if isinstance(parent, dict) else range(len(parent))) if k != key])
        parent[key], parent[other] = parent[other], value
    elif op == "same":
        parent[key] = copy.deepcopy(value)
    else:
        op, parent[key] = "retype", copy.deepcopy(rng.choice(ODD_VALUES))
    return f"{op} {'.'.join(map(str, path))}"


@pytest.mark.parametrize("model_type", list(EDITS))
def test_manifest_fuzz(tiny, tmp_path, model_type):
    store = str(tmp_path / "store")
    shutil.copytree(tiny.store(model_type), store)
    mpath = os.path.join(store, MANIFEST)
    with open(mpath) as f:
        text = f.read()
    base_doc = json.loads(text)
    base = run(store)
    rng = random.Random(27)
    outcomes, results = Counter(), {}
    for i in range(EDITS[model_type]):
        doc = copy.deepcopy(base_doc)
        reseal = rng.random() < 0.5
        if rng.random() < 0.05:  # broken JSON: cut short, or a character replaced by a NUL
            cut = rng.randrange(len(text))
            truncated = rng.random() < 0.5
            new_text = text[:cut] if truncated else text[:cut] + "\x00" + text[cut + 1:]
            what = "truncated" if truncated else "garbled"
        else:
            what = " + ".join(edit(doc, rng) for _ in range(rng.choice([1, 1, 1, 2])))
            doc = sealed(doc) if reseal else doc
            new_text = json.dumps(doc, indent=rng.choice([None, 1]))
        with open(mpath, "w") as f:
            f.write(new_text)
        where = f"edit {i} ({what}, {'resealed' if reseal else 'stale checksum'})"
        try:
            opened = open_store(store)
        except MoestreamError as e:
            assert "\n" not in str(e) and store in str(e), f"{where}: {e!r}"
            kind = "checksum" if "edited after pack" in str(e) else "JSON" if "valid JSON" in str(e) else "a field"
            outcomes["refused: " + kind] += 1
            continue
        assert reseal or manifest_digest(json.loads(new_text)) == manifest_digest(base_doc), f"{where}: opened"
        config_changed = json.loads(new_text)["config"] != base_doc["config"]
        key = json.dumps(opened.manifest.to_json(), sort_keys=True)
        if key not in results:
            try:
                results[key] = run(store)
            except MoestreamError as e:
                assert "\n" not in str(e), f"{where}: {e!r}"
                results[key] = None
        result = results[key]
        if result is None:
            outcomes["refused at load"] += 1
        elif config_changed and not (torch.equal(result[0], base[0]) and result[1] == base[1]):
            outcomes["forged config, runs"] += 1
        else:
            assert torch.equal(result[0], base[0]) and result[1] == base[1], f"{where}: output changed"
            outcomes["identical"] += 1
    print(model_type, dict(outcomes))
    assert sum(outcomes.values()) == EDITS[model_type]
    assert outcomes["refused: checksum"] and outcomes["refused: a field"] and outcomes["identical"]


def _edited(tiny, tmp_path, reseal: bool, **config) -> str:
    store = str(tmp_path / "store")
    shutil.copytree(tiny.store("qwen3_moe"), store)
    with open(os.path.join(store, MANIFEST)) as f:
        doc = json.load(f)
    doc["config"].update(config)
    with open(os.path.join(store, MANIFEST), "w") as f:
        json.dump(sealed(doc) if reseal else doc, f)
    return store


@pytest.mark.parametrize("top_k", [4, 6, 0])
def test_edited_num_experts_per_tok_is_refused(tiny, tmp_path, top_k):
    store = _edited(tiny, tmp_path, reseal=False, num_experts_per_tok=top_k)
    with pytest.raises(StoreError, match=r"manifest.json: edited after pack \(checksum mismatch\)") as err:
        open_store(store)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("top_k,message", [(0, "num_experts_per_tok must be an integer in \\[1, 8\\], got 0"),
                                           (9, "num_experts_per_tok must be"), ("4", "got '4'")])
def test_resealed_config_is_still_checked(tiny, tmp_path, top_k, message):
    with pytest.raises(MoestreamError, match=message):
        open_store(_edited(tiny, tmp_path, reseal=True, num_experts_per_tok=top_k))


def _bump(d: dict, key, by: int) -> None:
    d[key] += by


FIELD_EDITS = {  # a resealed edit of the qwen4_exp store -> what the refusal says
    "num_experts": (lambda m: _bump(m["experts"], "num_experts", 8), r"files.experts.q4.bin.size is \d+, its"),
    "hidden_size": (lambda m: _bump(m["experts"], "hidden_size", 64), r"experts.precisions.q4: hidden_size is 64, exp"),
    "stride": (lambda m: _bump(m["experts"]["precisions"]["q4"], "stride", 4096), r"q4: stride is 12288, expected"),
    "field shape": (lambda m: m["experts"]["precisions"]["bf16"]["fields"][2].update(shape=[64, 32]),
                    r"bf16: fields\[2\].shape is \(64, 32\), expected \(64, 64\)"),
    "layer order": (lambda m: m["experts"]["layer_ids"].reverse(), r"layer_ids \[3, 2, 1, 0\] are not the config's"),
    "ngram rows": (lambda m: _bump(m["ngram"][0], "rows", 1), r"files.ngram.0.bin.size is \d+, its layout makes it"),
    "ngram dim": (lambda m: _bump(m["ngram"][0], "dim", 16), r"ngram\[0\]: row_bytes is 32, expected 64"),
    "ngram layer": (lambda m: _bump(m["ngram"][0], "layer", 2), r"files.ngram.2.bin is missing"),
    "config experts": (lambda m: m["config"].update(num_experts=16, num_local_experts=16),
                       r"experts.num_experts is 8, the config"),
    "config ple": (lambda m: m["config"].update(ple_layer_ids=[]), r"ngram tables are for layers \[0\], the"),
    "dense dtype": (lambda m: m["dense"].update(dtype="float16"), r"holds bfloat16 tensors, the manifest's"),
    "model type": (lambda m: m.update(model_type="qwen3_moe"), r"model_type is 'qwen3_moe', its config makes 'qwen4"),
    "extra file": (lambda m: m["files"].update(x=m["files"]["dense.safetensors"]), r"files lists 'x', which no other"),
    "tokenizer": (lambda m: m["tokenizer_files"].append("gone.json"), r"tokenizer_files lists gone.json, which is not"),
    "unknown field": (lambda m: m["experts"].update(scale_dtype="float16"), r"experts has a field the format does not"),
}


@pytest.mark.parametrize("case", list(FIELD_EDITS))
def test_resealed_fields_are_checked_against_each_other_and_the_files(tiny, tmp_path, case):
    change, message = FIELD_EDITS[case]
    store = str(tmp_path / "store")
    shutil.copytree(tiny.store("qwen4_exp"), store)
    with open(os.path.join(store, MANIFEST)) as f:
        doc = json.load(f)
    change(doc)
    write_manifest(store, doc)
    with pytest.raises(StoreError, match=message) as err:
        open_store(store)
    assert "\n" not in str(err.value) and ("manifest.json" in str(err.value) or case == "dense dtype")


def test_manifest_without_checksum_or_of_version_1_is_refused(tiny, tmp_path):
    store = _edited(tiny, tmp_path, reseal=True)
    with open(os.path.join(store, MANIFEST)) as f:
        doc = json.load(f)
    del doc[MANIFEST_SHA256]
    with open(os.path.join(store, MANIFEST), "w") as f:
        json.dump(doc, f)
    with pytest.raises(StoreError, match="edited after pack \\(no manifest_sha256\\)"):
        open_store(store)
    with open(os.path.join(store, MANIFEST), "w") as f:
        json.dump(doc | {"format_version": 1}, f)
    with pytest.raises(StoreError, match="store format version 1, this moestream reads version 2; pack"):
        open_store(store)


def test_write_manifest_seals_what_it_writes(tiny, tmp_path):
    store = _edited(tiny, tmp_path, reseal=True)
    manifest = open_store(store).manifest
    write_manifest(store, manifest)
    assert open_store(store).manifest == manifest
    with open(os.path.join(store, MANIFEST)) as f:
        doc = json.load(f)
    doc["source"]["note"] = "rewritten"  # a dict is resealed: its old checksum is replaced
    write_manifest(store, doc)
    assert open_store(store).manifest.source["note"] == "rewritten"
    assert Manifest.from_json(sealed(doc)).source["note"] == "rewritten"
