"""The running service against its own OpenAPI schema (schemathesis) and arbitrary JSON (hypothesis): never a 500."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.test_limits import assert_nothing_internal
from tests.support.processes import service_process


@pytest.fixture(scope="module")
def live_url(tiny_datastore):
    """The real service (`python -m service`) on a loopback port."""
    env = {"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_LIMITS__MAX_BODY_BYTES": "20000"}
    with service_process(tiny_datastore, env=env) as svc:
        yield svc.url


def test_schema_conformance_and_no_server_errors(live_url, tiny_datastore):
    """Every operation of the service's own OpenAPI schema, with generated valid and invalid data.

    positive_data_acceptance is left out on purpose: "exactly one [MASK]" is a rule about the text that the
    schema cannot state, and such texts get a documented 422. No body, valid or not, shows a path of the machine,
    an OS error or an exception's text. (schemathesis' pytest plugin does not support
    pytest 9 yet, so the operations' hypothesis strategies are driven directly.)
    """
    schema = schemathesis.openapi.from_url(f"{live_url}/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        negative_data_rejection,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/predict", "/predict/batch", "/healthz", "/readyz", "/metrics"}
    for op in operations:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            response = case.call_and_validate(checks=checks)
            assert_nothing_internal(response.text, tiny_datastore, tiny_datastore.resolve())

        run()
    metrics = httpx.get(f"{live_url}/metrics").text
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('bertknn_requests_total{path="/predict"')
    )
    assert served >= 20, "schemathesis must really have called /predict"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
texts = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda a, m, b: f"{a}{m}{b}",
        st.text(max_size=40),
        st.sampled_from(["[MASK]", "[mask]", "[ Mask ]", "[MASK] [MASK]", "[MA\u200bSK]", "\u0301[MASK]\u200d"]),
        st.text(max_size=40),
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    payload=st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"text": texts},
            optional={"subject": st.one_of(st.text(max_size=30), json_values), "top_k": json_values, "k": json_values,
                      "retriever": json_values, "lambda": json_values, "num_articles": json_values},
        ),
    )
)
def test_arbitrary_json_gets_4xx_or_a_valid_answer(live_url, tiny_datastore, payload):
    r = httpx.post(f"{live_url}/predict", json=payload, timeout=30)
    assert r.status_code in (200, 422), r.text
    assert_nothing_internal(r.text, tiny_datastore)
    body = r.json()
    if r.status_code == 200:
        assert body["predictions"] and abs(sum(p["prob"] for p in body["predictions"])) <= 1.0 + 1e-6
    else:
        assert set(body["error"]) == {"code", "message", "request_id"} and body["error"]["message"]


def test_body_size_limit_and_malformed_json(live_url):
    big = httpx.post(f"{live_url}/predict", content=b'{"text": "' + b"a" * 30000 + b' [MASK]"}',
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "payload_too_large"
    bad = httpx.post(f"{live_url}/predict", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
