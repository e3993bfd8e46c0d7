"""moestream demo: a small MoE model built offline (random weights, deterministic), packed into a store
and run with a GPU/CPU pool a quarter of its experts, so experts really stream. Built once, then cached."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

DEMO_MODEL = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  moe_intermediate_size=128, intermediate_size=512, num_experts=64, num_experts_per_tok=4)
SAMPLING = dict(temperature=0.9, top_p=0.95, seed=0)  # seeded: the same words every run


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Tell me how the expert pool works.")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when a GPU is present, else cpu")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="pool size as a fraction of all experts")
    p.add_argument("--home", default=os.environ.get("MOESTREAM_HOME", os.path.expanduser("~/.cache/moestream")))


def build(home: str) -> str:
    """The demo store under `home`, built on first use (a pack is resumable, so a killed build recovers)."""
    from moestream.experts.format import FORMAT_VERSION, MANIFEST
    from moestream.packer.pack import PackOptions, pack
    from moestream.tiny import SPECIAL_TOKENS, WORDS, make_tiny_checkpoint

    ckpt, store = os.path.join(home, "demo-checkpoint"), os.path.join(home, "demo-store")
    manifest = os.path.join(store, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            if json.load(f).get("format_version") == FORMAT_VERSION:
                return store
        shutil.rmtree(store)  # the demo's own store, from an older moestream: built again
    print(f"building the demo model in {home} (once)...", file=sys.stderr)
    if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
        vocab = len(SPECIAL_TOKENS) + len(WORDS) + 1  # the word-level tokenizer's ids, <unk> last
        make_tiny_checkpoint(ckpt, "qwen3_moe", seed=0, words=True, vocab_size=vocab, **DEMO_MODEL)
    pack(ckpt, store, PackOptions(precisions=("q4",), show_progress=sys.stderr.isatty()))
    return store


def run(args: argparse.Namespace) -> int:
    from moestream.cli.common import report
    from moestream.engine.llm import LLM
    from moestream.engine.stream import TextStream
    from moestream.experts.store import open_store
    from moestream.sampling import SamplingParams

    store = build(args.home)
    m = open_store(store).manifest
    layout, total = m.layouts["q4"], m.geometry.num_records
    pool_gb = max(int(total * args.pool_fraction), m.config["num_experts_per_tok"]) * layout.stride / 1e9 * 1.0001
    llm = LLM(store, device=args.device, pool_gb=pool_gb, preload=False)
    try:
        size_mb = total * layout.stride / 1e6
        print(f"moestream demo: a {m.model_type} model with RANDOM weights ({m.geometry.num_layers} layers x "
              f"{m.geometry.num_experts} experts, top-{m.config['num_experts_per_tok']}; {size_mb:.0f} MB of Q4 "
              f"experts) on {llm.device.type}, expert pool {llm.provider.pool.num_slots} of {total} records. "
              f"The text is noise; the point is the streaming.\n", file=sys.stderr)
        ids = llm.tokenizer.chat([{"role": "user", "content": args.prompt}])
        start = time.perf_counter()
        stream = TextStream(llm, ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **SAMPLING))
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print("\n", file=sys.stderr)
        report(stream.output(), time.perf_counter() - start)
    finally:
        llm.close()
    return 0
