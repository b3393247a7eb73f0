"""The split layout in one test process: a `ModelServer` on a thread, and the environment an API process reads to
reach it, so that an app made with `create_app` sends its forward passes there (`RemoteEncoder`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Listener
from pathlib import Path

import pytest

from bertknn.service.model_client import ADDRESS_ENV, AUTHKEY_ENV
from bertknn.service.model_load import load_model
from bertknn.service.model_server import ModelServer
from bertknn.service.settings import ServiceSettings


@contextmanager
def model_process_here(settings: ServiceSettings, where: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModelServer]:
    """The model of ``settings``' datastore served as the model process serves it, at a socket under ``where``."""
    address, key = str(where / "model.sock"), b"test-model-process"
    server = ModelServer(load_model(settings, max_rows=64), Listener(address, family="AF_UNIX", authkey=key),
                         max_rows=64)  # fmt: skip
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    monkeypatch.setenv(ADDRESS_ENV, address)
    monkeypatch.setenv(AUTHKEY_ENV, key.hex())
    try:
        yield server
    finally:
        server.stop()
        server.listener.close()
        thread.join(5)
