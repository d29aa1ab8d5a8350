"""`streamrt serve`: the OpenAI-compatible server on the runtime's own uvloop loop.

The model is loaded as `streamrt run` loads it (same flags), the engine coroutine and
uvicorn's server run together on `StreamingRuntime.loop`: the scheduler's awaits and the
HTTP side share one loop and one thread, and the HTTP side runs between decode steps.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib
import socket
import sys
import time

from streamrt.errors import StreamrtError
from streamrt.cli.args import check_runtime_flags, parse_int
from streamrt.runtime.options import add_runtime_flags
from streamrt.api.session import resolve_model_dir

DEFAULT_PORT = 8000
MIN_CONNECTIONS = 256  # uvicorn's limit_concurrency at the least: clients, health checks, metrics scrapes
MAX_THREADS = 1024  # like verify's --workers; a count torch cannot start kills the process with a signal


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat, completions, tools, streaming, continuous batching)",
        description="Serve a converted streamrt tree (--model DIR; default: the embedded model) over "
        "OpenAI's Chat Completions API on 127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument("--model", metavar="DIR", help="converted streamrt tree (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", default=str(DEFAULT_PORT), metavar="N", help="TCP port (default 8000; 0: any free one)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the tree's name)")
    p.add_argument("--max-batch", default="16", metavar="B", help="rows in the decode batch (default 16)")
    p.add_argument("--max-queue", default="64", metavar="N",
                   help="requests waiting for a row before 503 + Retry-After (default 64)")
    p.add_argument("--max-context", metavar="N", help="prompt + completion tokens (default: the config's "
                   "max_position_embeddings)")
    p.add_argument("--prefill-chunk", default="256", metavar="N",
                   help="prompt tokens prefilled per decode step of the running batch, a multiple of 64 (default "
                        "256; 0: a whole prompt at once). A position's logits do not depend on the chunk size, so "
                        "greedy output equals `streamrt run`'s either way")
    p.add_argument("--threads", metavar="N", help=f"torch CPU threads, 1..{MAX_THREADS} (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_runtime_flags(p)
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    port = parse_int(args.port, "--port", 0)
    if port > 65535:
        raise StreamrtError(f"--port must be <= 65535, got {port}")
    max_batch, max_queue = parse_int(args.max_batch, "--max-batch", 1), parse_int(args.max_queue, "--max-queue", 0)
    context = parse_int(args.max_context, "--max-context", 2) if args.max_context is not None else None
    threads = parse_int(args.threads, "--threads", 1, MAX_THREADS) if args.threads is not None else None
    chunk = parse_int(args.prefill_chunk, "--prefill-chunk", 0)
    if chunk % 64:
        raise StreamrtError(f"--prefill-chunk must be a multiple of 64 (the KDA chunk), got {chunk}")
    if args.api_key is not None and not args.api_key.strip():
        # an unset variable in `--api-key "$KEY"` must not turn the key check off
        raise StreamrtError("--api-key must not be empty")
    if not args.host.strip():
        # '' binds every interface: an unset variable in `--host "$HOST"` must not expose the server
        raise StreamrtError("--host must not be empty (give 0.0.0.0 to listen on every interface)")
    check_runtime_flags(args)
    try:
        for name in ("fastapi", "uvicorn", "prometheus_client"):
            importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise StreamrtError(f"streamrt serve needs {exc.name}: pip install fastapi uvicorn prometheus-client") from None
    # Bound before the model loads, so a busy port or a bad --host costs no load, and held
    # until uvicorn listens on these very sockets, so the port cannot be taken in between.
    sockets = bind_sockets(args.host, port)
    try:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from streamrt.serve.runner import ModelRunner

        model_dir = resolve_model_dir(args.model, lambda m: print(m, file=sys.stderr))
        runner = ModelRunner(model_dir, args, max_batch=max_batch)
        try:
            runner.loop.run_until_complete(_serve(runner, args, sockets, max_batch, max_queue, context, chunk))
        finally:
            runner.close()
    finally:
        for sock in sockets:
            sock.close()
    return 0


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address `host` resolves to, as uvicorn's `loop.create_server` binds
    them (SO_REUSEADDR, IPv6 ones v6-only); port 0 takes a free one. Errors name the flag."""
    shown = host if host.isprintable() and len(host) <= 64 else repr(host[:64])
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StreamrtError(f"--host {shown}: cannot resolve ({e.strerror})") from None
    except UnicodeError:  # the IDNA codec: a label over 63 characters, an undecodable byte
        raise StreamrtError(f"--host {shown}: cannot resolve (not a valid host name)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this machine lacks (IPv6 off): create_server skips it too
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise StreamrtError(_bind_error(shown, port, family, address, e)) from None
        if not sockets:
            raise StreamrtError(f"--host {shown}: no address of it can be used on this machine")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_error(host: str, port: int, family: int, address: tuple, e: OSError) -> str:
    where = f"[{address[0]}]:{address[1]}" if family == socket.AF_INET6 else f"{address[0]}:{address[1]}"
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {where} is already in use"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: {address[0]} is not an address of this machine"
    if e.errno == errno.EACCES and 0 < port < 1024:
        return f"--port {port}: binding {where} needs privileges (ports below 1024); pick a port >= 1024"
    return f"--host {host} --port {port}: cannot bind {where} ({e.strerror})"


def build_state(runner, *, max_batch: int, max_queue: int, model_id: str | None = None,
                max_context: int | None = None, api_key: str | None = None, prefill_chunk: int = 0,
                thinking_effort: str | None = None):
    """Engine, metrics and the routes' state for a loaded runner (tests build servers with it too)."""
    from streamrt.serve.engine import Engine
    from streamrt.serve.metrics import ServeMetrics
    from streamrt.serve.routes import ServerState

    if max_context is not None and max_context > runner.max_context:
        # positions past the model's are outside what it was trained on (`streamrt run` refuses them too)
        raise StreamrtError(f"--max-context must be at most the model's context ({runner.max_context} tokens, "
                            f"max_position_embeddings), got {max_context}")
    metrics = ServeMetrics()
    engine = Engine(runner, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk, metrics=metrics,
                    prefix_cache=getattr(runner, "prefix", None))
    if runner.stats is not None:
        metrics.attach(engine, runner.stats, getattr(runner.model.backend, "counts", None))  # --cpu-experts
    return ServerState(engine=engine, tokenizer=runner.tokenizer, model_id=model_id or runner.name,
                       max_context=max_context or runner.max_context, metrics=metrics, api_key=api_key,
                       created=int(time.time()), thinking_effort=thinking_effort)


async def _serve(runner, args, sockets: list[socket.socket], max_batch: int, max_queue: int, context: int | None,
                 chunk: int) -> None:
    import uvicorn

    from streamrt.serve.app import create_app

    state = build_state(runner, max_batch=max_batch, max_queue=max_queue, model_id=args.served_model_name,
                        max_context=context, api_key=args.api_key, prefill_chunk=chunk,
                        thinking_effort=runner.chat.thinking_effort)
    # no host or port here: uvicorn listens on `sockets`, bound by serve_command. Past
    # `limit_concurrency` open connections uvicorn answers 503 at once: more requests than the
    # engine can batch and queue only wait, and each may buffer a body of up to max_body bytes.
    config = uvicorn.Config(create_app(state), log_level=args.log_level, lifespan="off", timeout_graceful_shutdown=2,
                            limit_concurrency=max(MIN_CONNECTIONS, 2 * (max_batch + max_queue)))
    server = uvicorn.Server(config)
    engine = asyncio.ensure_future(state.engine.run())
    ready = asyncio.ensure_future(_announce(server, state, max_batch, max_queue))
    try:
        await server.serve(sockets=sockets)
    finally:
        ready.cancel()
        state.engine.stop()
        await engine


async def _announce(server, state, max_batch: int, max_queue: int) -> None:
    while not server.started:
        await asyncio.sleep(0.01)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    print(f"streamrt: serving {state.model_id} on http://{host}:{port} (batch {max_batch}, queue {max_queue}, "
          f"context {state.max_context}); Ctrl-C stops", file=sys.stderr, flush=True)
