"""moestream stats [--url URL] [summary|layers|experts LAYER] [--json]: read a running server's counters."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

from moestream.errors import MoestreamError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("view", nargs="?", default="summary", choices=["summary", "layers", "experts"])
    p.add_argument("layer", nargs="?", type=int, help="record layer, for `experts`")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server address (default http://127.0.0.1:8080)")
    p.add_argument("--api-key", help="bearer token, if the server requires one")
    p.add_argument("--limit", type=int, default=32, help="experts to list (default 32)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")


def fetch(url: str, api_key: str | None) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/stats")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        raise MoestreamError(f"{url} answered {e.code} {e.reason}" + (" (wrong or missing --api-key?)"
                                                                       if e.code == 401 else "")) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise MoestreamError(f"no moestream server at {url} ({reason}); start one with `moestream serve`") from None
    except json.JSONDecodeError:
        raise MoestreamError(f"{url}/v1/stats did not answer JSON; is it a moestream server?") from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from moestream.stats import render

    data = fetch(args.url, args.api_key)
    engine = data.get("engine", data)
    if args.json:
        print(json.dumps(engine if args.view != "experts" else engine.get("experts", []), indent=1))
        return 0
    console = Console()
    if args.view == "summary":
        console.print(render.summary_table(engine))
    elif args.view == "layers":
        console.print(render.layers_table(engine))
    else:
        if args.layer is None:
            raise MoestreamError("`moestream stats experts` needs a LAYER number")
        try:
            console.print(render.experts_table(engine, args.layer, args.limit))
        except IndexError as e:
            raise MoestreamError(str(e)) from None
    return 0
