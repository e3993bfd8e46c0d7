"""Options shared by the commands that run a model (generate, chat, serve, bench)."""

from __future__ import annotations

import argparse

from moestream.config import DECODE_MODES, MAX_BATCH, MAX_DRAFTS, MAX_GPUS, SPECULATION, EngineConfig

DEFAULTS = EngineConfig()


def add_engine_args(p: argparse.ArgumentParser, defaults: EngineConfig = DEFAULTS) -> None:
    """The engine options, each defaulting to `defaults` (an EngineConfig: the dataclass's own, or a command's)."""
    e = defaults.expert
    p.add_argument("store", help="store folder written by `moestream pack`")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when a GPU is present, else cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--gpu-gb", type=float,
                   help="GPU memory the engine may take in decimal GB: dense weights, decode state, activations, "
                        "ring and the expert pool, which gets the rest (default: the pool from free memory)")
    p.add_argument("--pool-gb", type=float, help="GPU expert pool in decimal GB (default: from free memory)")
    p.add_argument("--ngram-tier", choices=["auto", "host", "disk"],
                   help="qwen4_exp's n-gram tables: pinned host memory (decode graphed), disk, or host when it fits "
                        f"(default {defaults.ngram_tier})")
    p.add_argument("--host-gb", type=float, help=f"pinned host-RAM expert tier in GB (default {e.host_gb:g}: off)")
    p.add_argument("--experts", type=int, choices=[4, 3, 2, 16],
                   help="expert precision (default: what the store holds, 4-bit first)")
    p.add_argument("--miss-experts", type=int, choices=[3, 2],
                   help="with --experts 4: fetch demand and ring misses at 3 or 2 bits (pool fills stay 4-bit)")
    p.add_argument("--ring", type=int, dest="ring_slots", help=f"prefill ring slots (default {e.ring_slots})")
    p.add_argument("--group", type=int, dest="ring_group", help=f"experts per ring batch (default {e.ring_group})")
    p.add_argument("--no-lookahead", action="store_false", dest="lookahead", default=None,
                   help="do not prefetch the next layer's experts")
    p.add_argument("--no-ring-lookahead", action="store_false", dest="ring_lookahead", default=None,
                   help="prefill: do not start the next layer's ring copies before this layer is done")
    p.add_argument("--max-context", type=int,
                   help=f"positions a decode state covers at load, grown past it (default {defaults.max_context})")
    p.add_argument("--kv-tokens", type=int,
                   help="positions the paged KV cache holds across running sequences; a request waits until the "
                        "blocks its prompt and max tokens may fill are free (default: 2 x --max-context under "
                        "--gpu-gb, else it grows)")
    p.add_argument("--prefill-chunk", type=int,
                   help=f"prompt tokens per prefill forward (default {defaults.prefill_chunk}); prefix-cache "
                        "snapshots are taken every chunk")
    p.add_argument("--prefill-graph-tokens", type=int,
                   help=f"whole prompts up to this many tokens run padded (to 32-512, then multiples of 512), each "
                        f"size a CUDA graph captured at load when every expert is resident (default "
                        f"{defaults.prefill_graph_tokens}; a multiple of 512)")
    p.add_argument("--prefix-cache-mb", type=float,
                   help=f"host memory for prompt-prefix snapshots in decimal MB (default {defaults.prefix_cache_mb:g}; "
                        "0: off)")
    p.add_argument("--decode-mode", choices=DECODE_MODES,
                   help=f"decode steps: captured CUDA graphs, the same step eager, or routed through the host every "
                        f"layer (default {defaults.decode_mode})")
    p.add_argument("--spec", choices=SPECULATION, dest="speculation",
                   help="speculative decoding: drafts from prompt lookup or the model's MTP head, verified in one "
                        f"step, the same greedy tokens (default {defaults.speculation})")
    p.add_argument("--drafts", type=int, choices=range(MAX_DRAFTS + 1), metavar=f"0..{MAX_DRAFTS}",
                   help=f"drafts a verify step checks (default: chosen each step from the acceptance, up to "
                        f"{MAX_DRAFTS})")
    p.add_argument("--max-batch", type=int, choices=range(1, MAX_BATCH + 1), metavar=f"1..{MAX_BATCH}",
                   help=f"sequences decoded together, each with its own recurrent states and KV blocks (default "
                        f"{defaults.max_batch}; 1 with --spec mtp; with --spec lookup a sequence drafts while it runs "
                        "alone)")
    p.add_argument("--prefill-sms", type=sm_count, metavar="N|auto",
                   help="SMs a prompt's prefill may take while other sequences decode (a CUDA green context), so "
                        "that their steps keep the rest (default: "
                        f"{'every SM' if not defaults.prefill_sms else defaults.prefill_sms}; auto: 36%% of them)")
    p.add_argument("--gpus", type=int, choices=range(1, MAX_GPUS + 1), metavar=f"1..{MAX_GPUS}",
                   help="GPUs of this host to spread the experts over, expert e of each layer on GPU e %% N, each with "
                        "--pool-gb and --host-gb of its own (default 1)")


def sm_count(value: str) -> int | str:
    """--prefill-sms: a number of SMs or auto (argparse names this function in its one-line error)."""
    return value if value == "auto" else int(value)


ENGINE_ARGS = ("device", "dtype", "gpu_gb", "ngram_tier", "pool_gb", "host_gb", "experts", "miss_experts",
               "ring_slots", "ring_group", "lookahead", "ring_lookahead", "max_context", "kv_tokens", "prefill_chunk",
               "prefill_graph_tokens", "prefix_cache_mb", "decode_mode", "speculation", "drafts", "max_batch",
               "prefill_sms", "gpus")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from moestream.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          stop=tuple(args.stop))


def open_llm(args: argparse.Namespace, defaults: EngineConfig = DEFAULTS):
    """The `LLM` the engine options ask for: `defaults` with the options given replaced."""
    from moestream.engine.llm import LLM

    return LLM(args.store, defaults, **{k: getattr(args, k) for k in ENGINE_ARGS if getattr(args, k) is not None})


def report(out, seconds: float | None = None) -> None:
    """A request's timings and what the expert cache did, on stderr."""
    import sys

    from moestream.stats.render import one_line

    t = out.stats["timings"]
    tail = f"; {seconds:.1f} s in all" if seconds is not None else f" ({out.finish_reason})"
    print(f"prompt {t['prompt_tokens']} tokens at {t['prefill_tok_s']:.1f} tok/s, generated "
          f"{t['generated_tokens']} at {t['decode_tok_s']:.1f} tok/s{tail}", file=sys.stderr)
    print(one_line(out.stats["experts"]), file=sys.stderr)
