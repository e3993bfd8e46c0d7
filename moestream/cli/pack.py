"""moestream pack SRC [-o OUT] [--experts 4|16|4,16]"""

from __future__ import annotations

import argparse
import os
import sys

from moestream.errors import MoestreamError
from moestream.experts.format import precision_name


def parse_precisions(text: str) -> tuple[str, ...]:
    try:
        return tuple(dict.fromkeys(precision_name(int(b)) for b in text.split(",")))
    except ValueError as e:
        raise MoestreamError(f"--experts {text}: {e}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="checkpoint folder (config.json + *.safetensors)")
    p.add_argument("-o", "--out", help="store folder to write (default: SRC-moestream)")
    p.add_argument("--experts", default="4", help="expert precisions to store: 4, 16 or both as 4,16 (default 4)")
    p.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")


def run(args: argparse.Namespace) -> int:
    from moestream.packer.pack import PackOptions, pack

    out = args.out or args.src.rstrip("/") + "-moestream"
    opts = PackOptions(precisions=parse_precisions(args.experts), show_progress=not args.no_progress)
    manifest = pack(args.src, out, opts)
    size = sum(f.size for f in manifest.files.values()) / 1e9
    layers = manifest.geometry.num_layers
    print(f"packed {manifest.model_type}: {layers} expert layers x {manifest.geometry.num_experts} experts, "
          f"{', '.join(manifest.layouts)}; {size:.2f} GB in {os.path.abspath(out)}", file=sys.stderr)
    return 0
