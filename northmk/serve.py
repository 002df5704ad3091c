"""`python -m northmk.serve`: the OpenAI-compatible server.

With no arguments it serves the built-in default model on http://127.0.0.1:8000.
SIGINT/SIGTERM: stop accepting connections, let in-flight requests finish for up to
--drain-timeout seconds, cancel the rest, shut the engine down, flush traces, exit 0.
Tracing is configured by the standard OTEL_* environment variables (see northmk.tracing).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from . import telemetry
from .server import ServerConfig, create_app
from .server.config import MIB

DEFAULT_NAME = "northmk-default"  # served name of the built-in model
EXIT_USAGE = 2

log = telemetry.get_logger("northmk.serve")


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from .engine.config import BACKENDS

    p = _Parser(prog="python -m northmk.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the built-in random-weight model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--device", default=None,
                   help="cpu | cuda | cuda:N (default: cuda with --backend megakernel, else cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto: the decode megakernel where it can run (sm_90, bfloat16, a geometry it implements), "
                        "else torch")
    p.add_argument("--max-batch", type=_positive, default=8, help="rows in the decode batch")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="context limit in tokens (default: the checkpoint's)")
    p.add_argument("--max-waiting", type=_positive, default=256,
                   help="queued requests beyond which the server answers 503")
    p.add_argument("--num-kv-pages", type=_positive, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-decode-ahead", action="store_true",
                   help="megakernel: wait for each decode step's tokens before enqueuing the next step")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model` (default: the checkpoint directory's name)")
    p.add_argument("--api-key", default=os.environ.get("NORTHMK_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' (default: $NORTHMK_API_KEY)")
    p.add_argument("--max-body-mb", type=_positive, default=8, help="larger request bodies get 413")
    p.add_argument("--max-concurrent-requests", type=_positive, default=None,
                   help="generation requests in flight beyond which the server answers 429")
    p.add_argument("--drain-timeout", type=_non_negative, default=30.0,
                   help="seconds in-flight requests may take to finish on shutdown")
    p.add_argument("--log-level", default="info", choices=telemetry.LEVELS)
    p.add_argument("--log-format", default="json", choices=("json", "console"))
    return p


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def configs(args: argparse.Namespace):
    """(EngineConfig, ServerConfig) from parsed arguments; ValueError on bad combinations."""
    from .default_model import resolve_model
    from .engine.config import EngineConfig

    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json in that directory")
    names = tuple(args.served_model_name or (Path(args.model).name if args.model else DEFAULT_NAME,))
    device = args.device or ("cuda" if args.backend == "megakernel" else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    engine = EngineConfig(
        model=args.model, device=device, dtype=dtype, backend=args.backend, max_batch=args.max_batch,
        max_model_len=args.max_model_len, num_kv_pages=args.num_kv_pages, max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching, served_model_name=names[0],
        decode_ahead=not args.no_decode_ahead,
    )
    model = resolve_model(args.model)  # after validation: may build the default model
    engine = dataclasses.replace(engine, model=model)
    server = ServerConfig(
        served_model_names=names, model_root=str(model), api_key=args.api_key,
        max_body_bytes=args.max_body_mb * MIB, max_concurrent_requests=args.max_concurrent_requests,
        drain_timeout_s=args.drain_timeout,
    )
    return engine, server


async def serve(app: web.Application, host: str, port: int, drain_timeout_s: float) -> None:
    """Run until SIGINT/SIGTERM, then shut down gracefully."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_timeout_s)
    await runner.setup()  # starts the engine (the app's cleanup_ctx)
    try:
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        for address in runner.addresses:
            log.info("listening", url=f"http://{address[0]}:{address[1]}")
        await stop.wait()
        log.info("shutting down", drain_timeout_s=drain_timeout_s)
    finally:
        await runner.cleanup()  # stop accepting, drain/cancel handlers, stop the engine


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        engine_config, server_config = configs(args)
        telemetry.configure(args.log_level, json_logs=args.log_format == "json")
        from .engine import AsyncEngine

        engine = AsyncEngine.from_config(engine_config)  # loads the checkpoint (blocking)
    except (UsageError, ValueError) as error:
        return _fail(error, EXIT_USAGE)
    from .parsing import cohere_parser_factory
    from .tracing import configure_tracing

    tracing = configure_tracing()  # from the OTEL_* variables; off without them
    app = create_app(server_config, engine, parser_factory=cohere_parser_factory, tracing=tracing)
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(app, args.host, args.port, server_config.drain_timeout_s))
    except OSError as error:  # e.g. the port is taken
        return _fail(error, 1)
    return 0


def _fail(error: BaseException, status: int) -> int:
    print(f"python -m northmk.serve: error: {error}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
