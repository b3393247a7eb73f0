"""``bert-knn serve`` / ``python -m service``: serve BERT-kNN over HTTP with uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from bertknn.core import logs, runtime
from bertknn.core.errors import BertKnnError
from bertknn.core.format import read_manifest
from bertknn.core.model_ref import check_model_dir, locate_model
from bertknn.core.settings_cli import (
    add_settings_flags,
    env_variables,
    error_message,
    error_source,
    settings_overrides,
    unknown_variables,
)
from bertknn.service.model_client import ADDRESS_ENV, AUTHKEY_ENV
from bertknn.service.model_process import ModelProcess
from bertknn.service.processes import (
    ARGV_ENV,
    RUN_DIR_ENV,
    default_workers,
    make_run_dir,
    remove_stale_run_dirs,
    worker_env,
)
from bertknn.service.settings import ServiceSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

STARTUP_FAILURE = 3  # uvicorn's exit code for a worker that could not start

# BERTKNN_* variables that are not the service's settings: the builder's commands' (BERTKNN_BUILD__*, and the
# old BERTKNN_BUILD_* it still reads) and what a server passes to its own processes
NOT_THE_SERVICES = ("BERTKNN_BUILD_", "BERTKNN_ADD_", "BERTKNN_RECODE_", ARGV_ENV, RUN_DIR_ENV, ADDRESS_ENV, AUTHKEY_ENV)

# flags kept from before the flags were generated: existing scripts call them
ALIASES = {"model.name": ("--model",), "model.device": ("--device",), "cache.redis_url": ("--redis-url",)}


def build_parser(prog: str = "python -m service") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve BERT-kNN over HTTP. Every flag is a setting; each also reads from the environment "
        "(BERTKNN_<GROUP>__<NAME>, e.g. BERTKNN_CACHE__REDIS_URL): docs/configuration.md lists them.",
    )
    add_settings_flags(p, ServiceSettings, aliases=ALIASES)
    return p


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    return ServiceSettings(**settings_overrides(args, ServiceSettings))


def main(argv: list[str] | None = None, prog: str = "python -m service") -> int:
    # The images, the quick start and every benchmark run the Rust tokenizer without its thread pool (each
    # request's tokenisation is one short call, made on the calling thread); a bare `bert-knn serve` does the same,
    # for itself and the processes it starts, unless the environment says otherwise.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser(prog).parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        given = settings_overrides(args, ServiceSettings)
        for err in exc.errors():
            print(f"error: {error_source(err['loc'], ServiceSettings, given)}: {error_message(err)}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, fmt=settings.log_format)
    for line in unknown_variables(env_variables(ServiceSettings), "BERTKNN_", others=NOT_THE_SERVICES):
        logger.warning(line)  # (before the first-run checks: a misspelt BERTKNN_DATASTORE explains their error)
    problem = preflight(settings)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    workers = settings.workers or default_workers(_device(settings), runtime.cpu_quota_threads())
    if workers > 1 or settings.layout == "split":
        argv = list(sys.argv[1:] if argv is None else argv)
        return serve_workers(settings, [*argv, "--workers", str(workers)], workers)
    import uvicorn

    from bertknn.service.main import create_app

    app = create_app(settings)
    # Kubernetes: a preStop sleep lets the endpoints drop this pod before SIGTERM; uvicorn then stops accepting,
    # lets requests in flight finish (at most graceful_shutdown_s) and runs the lifespan's shutdown.
    server = uvicorn.Server(uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=logs.uvicorn_config(settings.log_format),
        access_log=False,  # the request middleware logs each request, with its id and latency
        timeout_graceful_shutdown=settings.graceful_shutdown_s or None,
    ))  # fmt: skip
    quiet = _ExplainedStartupFailure(app)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run()
    except SystemExit:  # uvicorn's start-up failure (exit code 3)
        if app.state.startup_error:
            return 2  # explained in one line: a datastore or model problem the user fixes
        raise
    return 0


def _device(settings: ServiceSettings) -> str:
    """The device the model will run on (auto: CUDA when one is there), without loading anything else."""
    if settings.model.device != "auto":
        return settings.model.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def serve_workers(settings: ServiceSettings, argv: list[str], workers: int) -> int:
    """``workers`` server processes on one port under uvicorn's supervisor (`bertknn.service.processes`); with
    layout split, beside the model process they share (`bertknn.service.model_process`)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    log = logging.getLogger(__name__)
    logs.name_process("supervisor")  # (its workers and the model process name themselves)
    for stale in remove_stale_run_dirs():
        log.info("removed %s, left by a server that did not stop cleanly", stale)
    run_dir = make_run_dir()
    os.environ.update(worker_env(run_dir.root, argv))
    model = ModelProcess(settings, run_dir.root) if settings.layout == "split" else None
    if model is not None:  # started and serving before any API process: a model that cannot load stops here
        problem = model.start()
        if problem is not None:
            run_dir.remove()
            print(f"error: {problem}", file=sys.stderr)
            return 2
        os.environ.update(model.env())
        model.watch()
    config = uvicorn.Config(
        "bertknn.service.__main__:worker_app",
        factory=True,
        workers=workers,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=logs.uvicorn_config(settings.log_format),
        access_log=False,
        timeout_graceful_shutdown=settings.graceful_shutdown_s or None,
    )
    log.info("starting %d server processes on %s:%d", workers, settings.host, settings.port)
    try:
        supervisor = Multiprocess(config, sockets=[config.bind_socket()])
        supervisor.run()
    finally:
        if model is not None:
            model.stop()
        run_dir.remove()
    # a worker that could not start (its line is in the log) stops them all, as a single process would
    return 2 if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0


def worker_app() -> FastAPI:
    """One of `serve_workers`' processes: the app, from the command line the parent was given."""
    import threading

    from tqdm import tqdm

    # A spawned process's multiprocessing locks are registered with the parent's resource tracker, which warns of
    # them as leaked when the worker stops; tqdm (the model loader's progress bar) makes one unless given its own.
    tqdm.set_lock(threading.RLock())
    args = build_parser().parse_args(json.loads(os.environ[ARGV_ENV]))
    settings = settings_from_args(args)
    logs.configure(settings.log_level, role="worker", fmt=settings.log_format)
    from bertknn.service.main import create_app

    return create_app(settings)


def preflight(settings: ServiceSettings) -> str | None:
    """The mistakes a first run makes, found before anything loads (one line each): no datastore, a model that
    is not where the manifest or ``--model`` says, a busy port."""
    if not (settings.datastore / "manifest.json").is_file():
        return (
            f"{settings.datastore}: no datastore here (manifest.json missing); build one with "
            "`bert-knn build --corpus FILE --out DIR` and pass --datastore DIR"
        )
    try:
        manifest = read_manifest(settings.datastore)
        check_model_dir(locate_model(manifest.model.name, manifest.model.path, settings.model.name))
    except BertKnnError as exc:
        return str(exc)
    return port_problem(settings.host, settings.port)  # before the model loads, not after


class _ExplainedStartupFailure(logging.Filter):
    """Drops uvicorn's traceback of a start-up failure that the service explained in one line (a `BertKnnError`:
    a truncated shard, a model that is not the datastore's); other failures keep their traceback."""

    def __init__(self, app: object):
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        explained = getattr(getattr(self.app, "state", None), "startup_error", None)
        return not (explained and record.levelno >= logging.ERROR)


def port_problem(host: str, port: int) -> str | None:
    """Why the service could not listen on ``host:port`` (another process holds it), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            return (f"cannot listen on {host}:{port} ({exc.strerror or exc}): another process serves there; stop it "
                    "or pass --port")  # fmt: skip
    return None


if __name__ == "__main__":
    sys.exit(main())
