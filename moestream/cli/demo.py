"""moestream demo: the package's own trained MoE (`moestream/demo_model`, a 6-layer qwen3_moe with 32 experts
top-4 and an MTP head, trained by `training/` on Debian and npm text: Python docs, Linux docs, a dictionary)
run with a GPU/CPU pool a quarter of its experts, so experts really stream. `--random` builds and runs the
random-weight model the tests use instead (built once, then cached)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

DEMO_STORE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
RANDOM_MODEL = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    moe_intermediate_size=128, intermediate_size=512, num_experts=64, num_experts_per_tok=4)
# seeded: the same words every run; the trained model saw documents, not chats, so its prompt is raw text
SAMPLING = dict(temperature=0.6, top_p=0.9, repetition_penalty=1.2, seed=0)
RANDOM_SAMPLING = dict(temperature=0.9, top_p=0.95, seed=0)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help='text to continue (default "Python is"; with --random, a chat message)')
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when a GPU is present, else cpu")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="pool size as a fraction of all experts")
    p.add_argument("--random", action="store_true", help="the random-weight model instead of the trained one")
    p.add_argument("--home", default=os.environ.get("MOESTREAM_HOME", os.path.expanduser("~/.cache/moestream")),
                   help="where --random's model is built")


def build(home: str) -> str:
    """The random-weight demo store under `home`, built on first use (a pack is resumable, so a killed build
    recovers)."""
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
        make_tiny_checkpoint(ckpt, "qwen3_moe", seed=0, words=True, vocab_size=vocab, **RANDOM_MODEL)
    pack(ckpt, store, PackOptions(precisions=("q4",), show_progress=sys.stderr.isatty()))
    return store


def run(args: argparse.Namespace) -> int:
    from moestream.cli.common import report
    from moestream.engine.llm import LLM
    from moestream.engine.stream import TextStream
    from moestream.experts.store import open_store
    from moestream.sampling import SamplingParams

    store = build(args.home) if args.random else DEMO_STORE
    m = open_store(store).manifest
    layout, total = m.layouts["q4"], m.geometry.num_records
    pool_gb = max(int(total * args.pool_fraction), m.config["num_experts_per_tok"]) * layout.stride / 1e9 * 1.0001
    llm = LLM(store, device=args.device, pool_gb=pool_gb, preload=False)
    try:
        size_mb = total * layout.stride / 1e6
        what = "RANDOM weights" if args.random else "trained weights (the package's demo model)"
        print(f"moestream demo: a {m.model_type} model with {what} ({m.geometry.num_layers} record layers x "
              f"{m.geometry.num_experts} experts, top-{m.config['num_experts_per_tok']}; {size_mb:.0f} MB of Q4 "
              f"experts) on {llm.device.type}, expert pool {llm.provider.pool.num_slots} of {total} records."
              + (" The text is noise; the point is the streaming." if args.random else "") + "\n", file=sys.stderr)
        if args.random:
            ids = llm.tokenizer.chat([{"role": "user", "content": args.prompt or "Tell me how the expert pool works."}])
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **RANDOM_SAMPLING)
        else:
            prompt = args.prompt or "Python is"
            ids = llm.tokenizer.encode(prompt)
            params = SamplingParams(max_tokens=args.max_tokens, **SAMPLING)
            sys.stdout.write(prompt)
        start = time.perf_counter()
        stream = TextStream(llm, ids, params)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print("\n", file=sys.stderr)
        report(stream.output(), time.perf_counter() - start)
    finally:
        llm.close()
    return 0
