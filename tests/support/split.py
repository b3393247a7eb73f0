"""The split layout in one test process: a `ModelServer` on a thread, and the environment an API process reads to
reach it, so that an app made with `create_app` sends its forward passes there (`RemoteEncoder`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Listener
from pathlib import Path

import pytest

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.service.model_client import ADDRESS_ENV, AUTHKEY_ENV
from bertknn.service.model_load import load_model
from bertknn.service.model_server import ModelServer
from bertknn.service.settings import ServiceSettings

KEY = b"test-model-process"


@contextmanager
def serving(enc: MaskedLMEncoder, address: str, *, max_rows: int = 64) -> Iterator[list[int]]:
    """A `ModelServer` for ``enc`` on a thread, at ``address`` with `KEY`; yields the rows of each forward pass it
    ran. Stopped, it hangs up on every client."""
    rows: list[int] = []
    server = ModelServer(enc, Listener(address, family="AF_UNIX", authkey=KEY), max_rows=max_rows,
                         on_batch=rows.append)  # fmt: skip
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield rows
    finally:
        server.stop()
        server.listener.close()
        thread.join(5)


@contextmanager
def model_process_here(settings: ServiceSettings, where: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The model of ``settings``' datastore, loaded as the model process loads it, served at a socket under
    ``where`` that apps made meanwhile reach."""
    address = str(where / "model.sock")
    with serving(load_model(settings, max_rows=64), address):
        monkeypatch.setenv(ADDRESS_ENV, address)
        monkeypatch.setenv(AUTHKEY_ENV, KEY.hex())
        yield
