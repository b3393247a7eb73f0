"""The playground (`GET /ui`) in a real browser: headless Chromium (Debian's package) driven by Selenium against a
running service, every figure on the page checked against the API's own answer. A screenshot of each page is kept
in ``runs/test-artifacts`` (``BERT_KNN_TEST_ARTIFACTS``)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from tests.integration.test_limits import build_linked
from tests.support.browser import shot as _shot
from tests.support.browser import wait as _wait
from tests.support.processes import service_process

QUESTION = {"text": "zorblat was born in [MASK] .", "subject": "Zorblat"}


@pytest.fixture(scope="module")
def live(tiny_datastore: Path) -> Iterator[str]:
    with service_process(tiny_datastore, env={"BERTKNN_MODEL__DEVICE": "cpu"}) as svc:
        yield svc.url


def _width(el: Any) -> float:
    style = el.get_attribute("style")  # "width: 12.345%;"
    return float(style.split("width:")[1].split("%")[0])


def test_a_linked_question_shows_the_api_s_answers_bars_and_contexts(browser: Any, live: str) -> None:
    from selenium.webdriver.common.by import By

    api = httpx.post(f"{live}/predict", json=QUESTION, timeout=60).json()
    browser.get(f"{live}/ui?{urlencode(QUESTION)}")  # the question in the URL: the page asks at once
    rows = _wait(browser, "#answers .answer")
    assert [r.get_attribute("data-token") for r in rows] == [p["token"] for p in api["predictions"]]
    lam = api["lambda_used"]
    for row, p in zip(rows, api["predictions"], strict=True):
        assert float(row.get_attribute("data-prob")) == pytest.approx(p["prob"], rel=1e-6)
        knn, mlm = lam * p["p_knn"], (1 - lam) * p["p_mlm"]
        assert _width(row.find_element(By.CSS_SELECTOR, ".bar .knn")) == pytest.approx(100 * knn, abs=1e-3)
        assert _width(row.find_element(By.CSS_SELECTOR, ".bar .mlm")) == pytest.approx(100 * mlm, abs=1e-3)
        assert knn + mlm == pytest.approx(p["prob"], rel=1e-5)  # the bar is the whole answer
    top, best = rows[0], api["predictions"][0]
    assert top.find_element(By.CSS_SELECTOR, ".token").text == best["token"]
    assert best["contexts"], "the tiny datastore states the fact"
    marks = top.find_elements(By.CSS_SELECTOR, ".contexts mark")
    assert marks and marks[0].text.lower() == best["token"]  # the answer word highlighted in its sentence
    sentence = top.find_element(By.CSS_SELECTOR, ".contexts .sentence").text
    assert sentence == best["contexts"][0]["sentence"].replace("**", "")
    shown = [r.find_element(By.CSS_SELECTOR, "td").text for r in browser.find_elements(By.CSS_SELECTOR, ".article-row")]
    assert shown == [a["title"] for a in api["articles"]] and "subject" in browser.find_element(By.CSS_SELECTOR, ".meta").text
    assert browser.find_element(By.CSS_SELECTOR, "#preview .mask").text == "[MASK]"
    assert not browser.find_element(By.ID, "beam").is_displayed()  # the follow mode's knob stays out of this one
    _shot(browser, "playground-predict")


def test_enter_asks_and_a_refused_question_shows_the_api_s_message(browser: Any, live: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{live}/ui")
    box = _wait(browser, "#text")[0]
    box.send_keys("two [MASK] in one [MASK] .", Keys.ENTER)
    error = _wait(browser, "#error")[0]
    api = httpx.post(f"{live}/predict", json={"text": "two [MASK] in one [MASK] ."}, timeout=60).json()["error"]
    assert error.find_element(By.CSS_SELECTOR, ".code").text == api["code"]
    assert error.find_element(By.CSS_SELECTOR, ".message").text == api["message"]
    assert "text=two" in browser.current_url  # the link reproduces it
    _shot(browser, "playground-refused")


def test_follow_shows_the_path_through_each_hop(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    from selenium.webdriver.common.by import By

    ds = build_linked(tmp_path_factory.mktemp("ui-linked"))
    body = {"subject": "Orvin Tasker", "relations": ["[X] was born in [Y] .", "[X] is a city in the [Y] ."], "beam": 2,
            "top_k": 3}  # fmt: skip
    with service_process(ds, env={"BERTKNN_MODEL__DEVICE": "cpu"}) as svc:
        api = httpx.post(f"{svc.url}/follow", json=body, timeout=60).json()
        params = {"mode": "follow", "subject": body["subject"], "relations": "\n".join(body["relations"]),
                  "beam": 2, "top_k": 3}  # fmt: skip
        browser.get(f"{svc.url}/ui?{urlencode(params)}")
        answers = _wait(browser, "#answers .follow-answer")
        assert [a.get_attribute("data-title") for a in answers] == [a["title"] for a in api["answers"]]
        steps = [s.get_attribute("data-title") for s in answers[0].find_elements(By.CSS_SELECTOR, ".step")]
        assert steps == [s["title"] for s in api["answers"][0]["path"]] == ["Orvin Tasker", "New Quellport",
                                                                              "Kingdom of Zembla"]  # fmt: skip
        support = [m.text for m in answers[0].find_elements(By.CSS_SELECTOR, ".contexts mark")]
        assert "New Quellport" in support and "Kingdom of Zembla" in support  # each step's sentence
        _shot(browser, "playground-follow")


def test_the_page_is_the_package_s_own_and_calls_nothing_else(live: str) -> None:
    page = httpx.get(f"{live}/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # no CDN
    script = httpx.get(f"{live}/ui/app.js").text
    assert "fetch(" in script and "http" not in script.lower()  # relative paths only: this server's API
    assert httpx.get(f"{live}/ui/secrets.txt").status_code == 404
    home = httpx.get(f"{live}/")  # what a browser opens first leads to the page
    assert home.status_code == 307 and home.headers["location"] == "/ui", home.text
    assert httpx.get(f"{live}/", follow_redirects=True).text == page.text


def raw_get(url: str, target: str) -> tuple[int, str]:
    """GET ``target`` exactly as written (httpx would normalise ``..`` away before sending): (status, body)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode("ascii"))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode("utf-8", "replace")


@pytest.mark.parametrize("target", ["/ui/../manifest.json", "/ui/../../main.py", "/ui/..%2F..%2Fmain.py"])
def test_a_path_out_of_the_playground_reaches_no_file(live: str, target: str) -> None:
    """Sent raw, ``..`` reaches the server as written; no route serves a file outside the page's three."""
    status, body = raw_get(live, target)
    assert status == 404 and "create_app" not in body and "datastore_id" not in body, body[:200]


def test_the_playground_route_refuses_a_dot_dot_name_it_receives(live: str) -> None:
    """``%2e%2e`` is decoded to ``..`` and reaches the file route itself, which names what it got and refuses."""
    status, body = raw_get(live, "/ui/%2e%2e")
    assert status == 404 and "no playground file '..'" in body, body[:200]
