"""Python client for a running service, and ``python -m bertknn.service.client predict "..."`` (a readable table)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx
from pydantic import ValidationError

from bertknn.core.commands import SUMMARIES
from bertknn.core.settings_cli import add_command, flag_for
from bertknn.service.api.schemas import BatchResponse, PredictRequest, PredictResponse


class ServiceError(Exception):
    """The service answered with an error body; ``code`` and ``request_id`` come from it."""

    def __init__(self, status: int, code: str, message: str, request_id: str):
        super().__init__(f"{status} {code}: {message} (request {request_id})")
        self.status, self.code, self.message, self.request_id = status, code, message, request_id


# a connection that broke before its answer came (a server process that died, a keep-alive connection it closed):
# every request this client sends is a pure function of its body, so it is sent again
RETRIED_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)


class BertKnnClient:
    """A running service's `/predict` and `/predict/batch`. A request is sent again, at most ``retries`` times,
    when its connection broke before the answer came or when the service answered with ``Retry-After`` (overloaded,
    this client's cap reached, past its deadline), after the wait it names (at most ``max_wait_s``). A timeout is
    not retried: the service may still be working on it."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", *, timeout: float = 30.0, retries: int = 3,
        max_wait_s: float = 30.0, **kwargs: Any,
    ):  # fmt: skip
        if retries < 0 or max_wait_s < 0:
            raise ValueError("retries and max_wait_s must be >= 0")
        self._http = httpx.Client(base_url=base_url, timeout=timeout, **kwargs)
        self.retries = retries
        self.max_wait_s = max_wait_s

    def __enter__(self) -> BertKnnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, payload: dict) -> dict:
        for attempt in range(self.retries):
            try:
                r = self._http.post(path, json=payload)
            except RETRIED_ERRORS:
                time.sleep(min(self.max_wait_s, 0.1 * 2**attempt))
                continue
            wait = _retry_after(r)
            if wait is None:
                return _body(r)
            time.sleep(min(self.max_wait_s, wait))
        return _body(self._http.post(path, json=payload))  # the last try: its error is the caller's

    def predict(self, text: str, **options: Any) -> PredictResponse:
        req = PredictRequest.model_validate({"text": text, **options})
        return PredictResponse.model_validate(self._post("/predict", req.model_dump(by_alias=True, exclude_none=True)))

    def predict_batch(self, queries: list[dict]) -> BatchResponse:
        reqs = [PredictRequest.model_validate(q).model_dump(by_alias=True, exclude_none=True) for q in queries]
        return BatchResponse.model_validate(self._post("/predict/batch", {"queries": reqs}))

    def ready(self) -> dict:
        return self._http.get("/readyz").json()


def _retry_after(r: httpx.Response) -> float | None:
    """The seconds an error response asks the client to wait before it asks again (None: not to be retried)."""
    if r.status_code < 429 or "retry-after" not in r.headers:
        return None
    try:
        return max(0.0, float(r.headers["retry-after"]))
    except ValueError:
        return None  # an HTTP date: not what this service sends


def _body(r: httpx.Response) -> dict:
    """A response's JSON body; an error response raised as `ServiceError`."""
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = {"code": "http_error", "message": r.text[:200], "request_id": r.headers.get("x-request-id", "-")}
        raise ServiceError(r.status_code, err["code"], err["message"], err["request_id"])
    return r.json()


def format_table(resp: PredictResponse) -> str:
    lines = [f"{'#':>2}  {'answer':<16} {'p':>7} {'p_mlm':>7} {'p_knn':>7}  context"]
    for i, p in enumerate(resp.predictions, 1):
        ctx = p.contexts[0] if p.contexts else None
        where = f"[{ctx.article}] {ctx.sentence}" if ctx else ""
        lines.append(f"{i:>2}  {p.token:<16} {p.prob:7.4f} {p.p_mlm:7.4f} {p.p_knn:7.4f}  {where[:100]}")
    arts = ", ".join(f"{a.title} ({a.rule})" for a in resp.articles) or "-"
    lines.append(f"articles: {arts}")
    lines.append("mlm: " + ", ".join(f"{t.token} {t.prob:.3f}" for t in resp.mlm[:5]))
    lines.append("knn: " + ", ".join(f"{t.token} {t.prob:.3f}" for t in resp.knn[:5]))
    skipped = " (kNN skipped: the MLM was confident)" if resp.knn_skipped else ""
    lines.append(f"lambda: {resp.lambda_used:.3f} ({resp.interpolation}){skipped}")
    lines.append(f"timings_ms: {json.dumps(resp.timings_ms)}  cache: {json.dumps(resp.cache)}")
    lines += [f"warning: {w}" for w in resp.warnings]
    return "\n".join(lines)


def build_parser(prog: str = "python -m bertknn.service.client") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    sub = p.add_subparsers(dest="command", required=True)
    pr = add_command(sub, "predict", SUMMARIES["predict"], "a cloze question, its answers printed as a table "
                     "(or the response's JSON with --json)")  # fmt: skip
    pr.add_argument("text", help='e.g. "albert einstein was born in [MASK] ."')
    pr.add_argument("--url", default="http://127.0.0.1:8000", help="the service's address [default: %(default)s]")
    pr.add_argument("--subject", help="the question's subject: its article is searched (default: the retriever's)")
    pr.add_argument("--top-k", type=int, help="answers shown (default: the server's)")
    pr.add_argument("--retriever", choices=["bm25", "tfidf", "none"], help="how articles are ranked without a "
                    "subject (none: the whole datastore; default: the server's)")  # fmt: skip
    pr.add_argument("--interpolation", choices=["fixed", "adaptive"], help="default: the server's")
    pr.add_argument("--mlm-prior", type=float, help="the vote weighted by p_MLM to this power (0: the paper's "
                    "plain vote; default: the server's)")  # fmt: skip
    pr.add_argument("--json", action="store_true", help="print the raw JSON response")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bertknn.service.client") -> int:
    args = build_parser(prog).parse_args(argv)
    given = {"subject": args.subject, "top_k": args.top_k, "retriever": args.retriever,
             "interpolation": args.interpolation, "mlm_prior": args.mlm_prior}  # fmt: skip
    options = {k: v for k, v in given.items() if v is not None and v != ""}
    try:
        with BertKnnClient(args.url) as client:
            resp = client.predict(args.text, **options)
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:  # checked here, before any request: one line per bad flag
        for err in exc.errors(include_url=False):
            flag = "text" if tuple(err["loc"]) == ("text",) else flag_for(err["loc"])
            print(f"error: {flag}: {err['msg']}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(resp.model_dump_json(indent=1) if args.json else format_table(resp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
