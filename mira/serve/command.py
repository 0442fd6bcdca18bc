"""`mira serve`: arguments in, a model loaded, the OpenAI-compatible API served with uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from mira.errors import MiraError

API_KEY_VARIABLE = "MIRA_API_KEY"


def add_command(subparsers) -> None:
    from mira.cli_args import add_model_options, add_sampling_options, nonnegative_int, port
    from mira.serve.relay import STREAM_INTERVAL_S

    serve = subparsers.add_parser(
        "serve", help="serve the OpenAI API (chat and completions) over HTTP",
        description="Load one model and serve the OpenAI API over HTTP: GET /v1/models, POST /v1/chat/completions "
                    "and POST /v1/completions (streamed as server-sent events with \"stream\": true), GET /health "
                    "and GET /metrics (Prometheus). Log probabilities (logprobs) are the model's own, before "
                    "temperature and the other sampling settings; a completion's echo returns the prompt (its token "
                    "ids may stand for it) with its logprobs, and with max_tokens 0 scores the prompt alone. Tools go "
                    "to the model through its chat template and its calls come back through its tokenizer's response "
                    "template (or --response-template). "
                    "Images, response formats, logit bias, suffix, best_of and parallel_tool_calls false are refused "
                    "(400). Generations run one at a time on the device; others wait in a bounded queue. Needs "
                    "`pip install mira[serve]`.")
    add_model_options(serve, raw=False)
    add_sampling_options(serve, generation=False)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    serve.add_argument("--api-key", metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                            f"${API_KEY_VARIABLE} when set, else no key)")
    serve.add_argument("--max-queue", type=nonnegative_int, default=16, metavar="N",
                       help="requests that may wait for the device behind the running one; more are answered 429 "
                            "(default 16)")
    serve.add_argument("--stream-interval", type=nonnegative_int, default=round(STREAM_INTERVAL_S * 1000),
                       metavar="MS", help="send a stream's new text at most every MS milliseconds: fewer, larger "
                                          "chunks leave the generation more of the CPU (default %(default)s; 0: "
                                          "each piece at once)")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model's name in the API (default: the hub id, else the directory's name)")
    serve.add_argument("--response-template", metavar="FILE.json",
                       help="how to read tool calls out of the model's answers, in transformers' response template "
                            "format, for a checkpoint whose tokenizer_config.json has none (default: the "
                            "checkpoint's own)")
    serve.set_defaults(run=_serve)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (port 0: a free one), so the address can be told
    before the server runs.

    Raises:
        MiraError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise MiraError(f"cannot listen on {host}:{port} ({error.strerror}); pass another --port or --host") from None
    sock.listen(128)
    return sock


def model_name(model: str | None) -> str:
    from mira.models.hub import locate
    from mira.runtime.engine import BUNDLED_MODEL

    if model is None:
        return BUNDLED_MODEL.name
    source = locate(model)
    return source.repo_id or Path(model).resolve().name


def _serve(args: argparse.Namespace) -> None:
    from mira.cli_args import load_model, sampling_config

    try:
        import uvicorn

        from mira.serve.app import create_app
        from mira.serve.stopping import StoppingServer
        from mira.serve.tools import load_response_template
    except ImportError as error:
        raise MiraError(f"mira serve needs FastAPI and uvicorn ({error}); pip install 'mira[serve]'") from None
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    name = args.served_model_name or model_name(args.model)
    defaults = sampling_config(args)
    response_template = None if args.response_template is None else load_response_template(args.response_template)
    sock = listen(args.host, args.port)  # before loading: a port in use fails at once
    host, port = sock.getsockname()[:2]
    if not api_key and not ipaddress.ip_address(host).is_loopback:
        print(f"mira: warning: serving on {host} without an API key: anyone who can reach it can use it; pass "
              f"--api-key or set {API_KEY_VARIABLE}", file=sys.stderr)
    model = load_model(args)
    if response_template is not None:
        if model.tokenizer is None:
            raise MiraError(f"{model.store.path} has no tokenizer files to read tool calls with; drop "
                            "--response-template")
        model.tokenizer.response_template = response_template
    app = create_app(model, name, api_key=api_key, max_waiting=args.max_queue, defaults=defaults,
                     stream_interval_s=args.stream_interval / 1000)
    shown = f"[{host}]" if ":" in host else host
    print(f"mira: serving {name} at http://{shown}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    StoppingServer(uvicorn.Config(app, log_level="warning" if args.quiet else "info")).run(sockets=[sock])
