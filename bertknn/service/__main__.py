"""``python -m service --datastore DIR [--model NAME_OR_DIR] [--host H] [--port P] [--redis-url URL]``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from pydantic import ValidationError

from bertknn.service.settings import ServiceSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m service",
        description="Serve BERT-kNN over HTTP. Every flag also reads from the environment (BERTKNN_*).",
    )
    p.add_argument("--datastore", help="datastore directory (BERTKNN_DATASTORE)")
    p.add_argument("--model", help="masked LM name or directory; default: the manifest's (BERTKNN_MODEL__NAME)")
    p.add_argument("--host", help="bind address (BERTKNN_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (BERTKNN_PORT, default 8000)")
    p.add_argument("--redis-url", help="redis:// or rediss:// URL (BERTKNN_CACHE__REDIS_URL); unset = in-process LRU")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="BERTKNN_MODEL__DEVICE")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="BERTKNN_LOG_LEVEL")
    return p


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    overrides: dict[str, Any] = {}
    base = ServiceSettings()
    if args.datastore:
        overrides["datastore"] = args.datastore
    for name in ("host", "port", "log_level"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    model = base.model.model_dump()
    if args.model:
        model["name"] = args.model
    if args.device:
        model["device"] = args.device
    overrides["model"] = model
    cache = base.cache.model_dump()
    if args.redis_url:
        cache["redis_url"] = args.redis_url
    overrides["cache"] = cache
    return ServiceSettings(**{**base.model_dump(by_alias=True), **overrides})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        for err in exc.errors():
            print(f"error: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not (settings.datastore / "manifest.json").is_file():
        print(
            f"error: {settings.datastore}: no datastore here (manifest.json missing); build one with "
            "`python -m datastore_builder build --corpus FILE --out DIR` and pass --datastore DIR",
            file=sys.stderr,
        )
        return 2
    import uvicorn

    from bertknn.service.main import create_app
    from bertknn.service.server import uvicorn_config

    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings))
    delay = settings.shutdown_delay_s
    original = server.handle_exit

    def handle_exit(sig: int, frame: Any) -> None:
        # Readiness goes false first; in-flight requests finish; uvicorn then stops accepting and drains.
        resources = app.state.resources
        resources.draining = True
        if delay > 0 and sig == signal.SIGTERM:
            threading.Timer(delay, original, (sig, frame)).start()
        else:
            original(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    # uvicorn re-raises the signal after a graceful shutdown; a no-op handler makes that a clean exit (0)
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
