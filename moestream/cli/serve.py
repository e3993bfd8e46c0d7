"""moestream serve STORE: an OpenAI-compatible HTTP server (moestream/server) on 127.0.0.1:8080 by default.

The port is bound before the model loads, so a port in use is reported at once, in one line, and while it loads
/health answers 503 {"status": "loading"} (server/loading.py)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import signal
import socket
import sys

from moestream.cli.common import DEFAULTS, add_engine_args, open_llm
from moestream.errors import MoestreamError

# a server sees many prompts sharing prefixes (chat turns, system prompts): snapshots every 512 tokens, 1 GB of them;
# prompts that arrive while others decode keep to part of the GPU, so that the others' token gaps stay even
SERVE_DEFAULTS = dataclasses.replace(DEFAULTS, prefill_chunk=512, prefix_cache_mb=1024, prefill_sms="auto")
EPILOG = """endpoints: GET /v1/models, POST /v1/chat/completions (tools, logprobs, response_format, session_id),
POST /v1/completions (logprobs, echo), POST /v1/messages (Anthropic's), POST/GET/DELETE /v1/sessions, POST /tokenize
and /detokenize, GET /v1/stats (JSON), GET /metrics (Prometheus), GET /health. Sampling is greedy unless a request
sets temperature (OpenAI's default is 1); top_k, repetition_penalty and ignore_eos are accepted as extensions."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_engine_args(p, SERVE_DEFAULTS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("MOESTREAM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $MOESTREAM_API_KEY, else no key)")
    p.add_argument("--model-name", help="the model id clients use (default: the store folder's name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait behind the running one; "
                   "more are answered 429 (default 64)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted (default 4096)")
    p.add_argument("--max-body-bytes", type=int, default=1_000_000, help="largest request body (default 1 MB)")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a connection has to send a request's headers, and a request its body (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    try:
        from moestream.server import Server, ServerSettings, create_app
        from moestream.server.loading import while_loading
    except ImportError as e:
        raise MoestreamError(f"serve needs the server extra ({e.name} is missing): "
                             "pip install 'moestream[server]'") from None
    for name in ("max_queue", "max_tokens_limit", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise MoestreamError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.request_timeout < float("inf"):
        raise MoestreamError("--request-timeout must be a number of seconds > 0")
    sock = listen(args.host, args.port)
    llm = while_loading(sock, lambda: open_llm(args, SERVE_DEFAULTS))
    try:
        name = args.model_name or os.path.basename(os.path.normpath(args.store))
        settings = ServerSettings(model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                                  max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
                                  request_timeout_s=args.request_timeout)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        print(f"serving '{name}' at {url} (OpenAI-compatible; /metrics, /v1/stats)"
              + ("" if args.api_key else "; no API key required"), file=sys.stderr)
        if not args.api_key and host not in ("127.0.0.1", "::1", "localhost"):
            print(f"warning: {host} is reachable from other machines and no --api-key is set", file=sys.stderr)
        server = Server(create_app(llm, settings), log_level=args.log_level, timeout_graceful_shutdown=5)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: that is a normal stop
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
        print("stopped", file=sys.stderr)
    finally:
        llm.close()
        sock.close()
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket, or one clear error line (port in use, unknown address)."""
    if not 0 <= port <= 65535:
        raise MoestreamError(f"--port {port} is not a port number (0-65535)")
    sock = None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        if sock is not None:
            sock.close()
        reason = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise MoestreamError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock
