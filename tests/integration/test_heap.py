"""The served heap frozen out of the collector's full passes (`bertknn.service.heap`), and an exit as PID 1."""

from __future__ import annotations

import gc
import signal

import httpx
from fastapi.testclient import TestClient

from bertknn.service import heap
from bertknn.service.main import create_app
from bertknn.service.settings import ServiceSettings
from tests.support.processes import service_process

Q = {"text": "zorblat was born in [MASK] .", "subject": "zorblat"}


def test_start_up_freezes_what_it_loaded_and_stop_gives_it_back(tiny_datastore):
    app = create_app(ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}))
    before = gc.get_threshold()
    with TestClient(app) as client:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the model, the tokenizer, the vocabulary's words, the indexes
        assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *before[1:])
        assert client.post("/predict", json=Q).status_code == 200
        assert gc.get_freeze_count() <= frozen  # nothing a request makes is frozen (reference counting frees some)
    assert gc.get_freeze_count() == 0  # an app in a longer-lived process leaves nothing frozen behind
    assert gc.get_threshold() == before


def test_sigterm_as_pid1_ends_with_a_normal_exit(tiny_datastore):
    """SIGTERM's default action ignored, as for a container's PID 1: uvicorn's re-raised signal does nothing, and
    the process must still end by itself after its graceful shutdown, with exit code 0."""
    with service_process(tiny_datastore, env={"BERTKNN_MODEL__DEVICE": "cpu"}, as_pid1=True) as svc:
        assert httpx.post(f"{svc.url}/predict", json=Q, timeout=60).status_code == 200
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(60) == 0
