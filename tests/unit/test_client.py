"""The Python client sends a question again when its connection broke or the service asked it to wait, and
never otherwise."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from bertknn.service.client import BertKnnClient, ServiceError

ANSWER = {
    "predictions": [], "mlm": [], "knn": [], "articles": [], "lambda_used": 0.3, "temperature_used": 6.0,
    "timings_ms": {}, "cache": {},
    "model": {"name": "m", "weights_sha256": "0" * 64, "layer": 11, "num_layers": 12},
    "datastore": {"id": "d", "version": 1, "articles": 1, "contexts": 1, "model_name": "m"},
}  # fmt: skip


def _error(status: int, code: str, retry_after: str | None = None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return httpx.Response(status, headers=headers, json={"error": {"code": code, "message": code, "request_id": "r"}})


def _client(replies: list[Callable[[httpx.Request], httpx.Response]], **kwargs: object) -> tuple[BertKnnClient, list]:
    """A client whose n-th request gets ``replies[n]``; the requests it sent."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return replies[len(sent) - 1](request)

    return BertKnnClient("http://svc", transport=httpx.MockTransport(handler), **kwargs), sent  # type: ignore[arg-type]


def _broken(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)


def _ok(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=ANSWER)


def test_a_broken_connection_and_an_overloaded_answer_are_retried():
    client, sent = _client([_broken, lambda _: _error(503, "overloaded", "0"), lambda _: _error(429, "too_many_requests", "0"), _ok])
    assert client.predict("x [MASK] .").lambda_used == 0.3
    assert len(sent) == 4 and len({r.content for r in sent}) == 1  # the same question each time


def test_retries_run_out_with_the_last_error():
    client, sent = _client([lambda _: _error(503, "overloaded", "0")] * 3, retries=2)
    with pytest.raises(ServiceError, match="503 overloaded"):
        client.predict("x [MASK] .")
    assert len(sent) == 3
    client, sent = _client([_broken] * 2, retries=1)
    with pytest.raises(httpx.RemoteProtocolError):
        client.predict("x [MASK] .")
    assert len(sent) == 2


@pytest.mark.parametrize(
    "reply",
    [lambda _: _error(422, "invalid_query"), lambda _: _error(503, "not_ready"),
     lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=r))],
    ids=["bad question", "503 without Retry-After", "timeout"],
)  # fmt: skip
def test_what_would_fail_again_or_may_still_run_is_not_retried(reply: Callable[[httpx.Request], httpx.Response]):
    client, sent = _client([reply, _ok])
    with pytest.raises((ServiceError, httpx.ReadTimeout)):
        client.predict("x [MASK] .")
    assert len(sent) == 1


def test_the_wait_is_the_one_the_service_names_within_the_cap(monkeypatch: pytest.MonkeyPatch):
    slept: list[float] = []
    monkeypatch.setattr("bertknn.service.client.time.sleep", slept.append)
    client, _ = _client([lambda _: _error(503, "overloaded", "2"), lambda _: _error(503, "overloaded", "90"), _ok],
                        max_wait_s=5)  # fmt: skip
    client.predict("x [MASK] .")
    assert slept == [2.0, 5.0]
