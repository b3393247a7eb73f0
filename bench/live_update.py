"""Live update: ``add`` of a few articles against a rebuild, and a running service switching versions under load.

    python -m bench.live_update          # proxy model, data/sample_wiki.jsonl: 30 articles, then +6 new, 3 changed

1. builds the base datastore (BM25, TF-IDF, IVF-PQ) from the first ``--base`` articles;
2. starts the service on it (``python -m service``, a real process, admin token set);
3. while ``--clients`` threads keep sending ``/predict``, runs ``add`` (in this process) with the next ``--new``
   articles and ``--changed`` base articles given a new last sentence, then ``POST /admin/reload``;
4. rebuilds the final corpus from scratch with the same settings, beside the same client load (so that the
   add/rebuild ratio compares like with like).

It prints and writes ``bench/results/live_update.json``: add and rebuild seconds (and their ratio), contexts
embedded by each, the reload's seconds, and the requests answered during the switch by version and status.
The model is loaded once in this process (outside the timings); the service loads its own copy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from bench.common import PROXY_MODEL, REPO, machine, percentiles, service_process, write_result
from bertknn.builder.build import build
from bertknn.builder.settings import AddSettings, BuildSettings
from bertknn.builder.update import add_articles
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.runtime import cpu_quota_threads

TOKEN = "bench-admin-token"


def _write(path: Path, articles: list[dict]) -> Path:
    path.write_text("".join(json.dumps(a, ensure_ascii=False) + "\n" for a in articles), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_update", description=__doc__)
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "sample_wiki.jsonl")
    p.add_argument("--base", type=int, default=30)
    p.add_argument("--new", type=int, default=6)
    p.add_argument("--changed", type=int, default=3)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    args = p.parse_args(argv)

    articles = [json.loads(line) for line in args.corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    base, fresh = articles[: args.base], articles[args.base : args.base + args.new]
    changed = [{**a, "text": a["text"] + " In 2031 it was renamed after the river."} for a in base[: args.changed]]
    work = args.out or Path(tempfile.mkdtemp(prefix="bench-live-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        torch.set_num_threads(cpu_quota_threads())
        encoder = MaskedLMEncoder.load(args.model, layer=-2, device="cpu", max_seq_len=128)

        def settings(corpus: Path, out: Path) -> BuildSettings:
            return BuildSettings(corpus=[corpus], model=args.model, out=out, device="cpu", ivfpq=True, workers=0,
                                 articles_per_shard=25)  # fmt: skip

        t = time.perf_counter()
        base_manifest = build(settings(_write(work / "base.jsonl", base), work / "ds"), encoder)
        base_s = time.perf_counter() - t
        update = _write(work / "update.jsonl", fresh + changed)
        final = _write(work / "final.jsonl", changed + base[args.changed :] + fresh)

        results: list[tuple[int, int, float]] = []  # status, datastore version (-1: failed), seconds
        stop = threading.Event()
        questions = [{"text": f"{a['title'].lower()} is a [MASK] .", "subject": a["title"]} for a in base[:20]]

        def client(i: int) -> None:
            with httpx.Client(timeout=120) as c:
                n = i
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        r = c.post(f"{url}/predict", json=questions[n % len(questions)])
                        version = r.json()["datastore"]["version"] if r.status_code == 200 else -1
                        results.append((r.status_code, version, time.perf_counter() - t0))
                    except httpx.HTTPError:
                        results.append((0, -1, time.perf_counter() - t0))
                    n += 1
                    time.sleep(0.01)

        with service_process(work / "ds", env={"BERTKNN_ADMIN_TOKEN": TOKEN}, args=("--device", "cpu")) as svc:
            url = svc.url
            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            for th in threads:
                th.start()
            try:
                time.sleep(2)
                at_add = len(results)
                t = time.perf_counter()
                result = add_articles(
                    AddSettings(datastore=work / "ds", corpus=[update], model=args.model, device="cpu"), encoder
                )
                add_s = time.perf_counter() - t
                before_reload = len(results)
                r = httpx.post(f"{url}/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
                reload_body = r.json()
                t = time.perf_counter()
                rebuilt = build(settings(final, work / "rebuild"), encoder)
                rebuild_s = time.perf_counter() - t
            finally:
                stop.set()
                for th in threads:
                    th.join()
        added_contexts = sum(s.rows for s in result.manifest.shards[len(base_manifest.shards) :])
        payload = {
            "benchmark": "live_update",
            "model": Path(args.model).name,
            "corpus": f"{args.corpus.name}: base {args.base} articles, update {args.new} new + {args.changed} changed",
            "machine": machine(),
            "base_build_s": round(base_s, 2),
            "base_contexts": base_manifest.counts.contexts,
            "add": {**result.summary(), "seconds": round(add_s, 2), "contexts_embedded": added_contexts},
            "rebuild": {"seconds": round(rebuild_s, 2), "contexts": rebuilt.counts.contexts,
                        "same_contexts_as_update": rebuilt.counts.contexts == result.manifest.counts.contexts},
            "load": f"{args.clients} client threads sending /predict (20 questions in turn) during add, reload and rebuild",
            "add_over_rebuild": round(add_s / rebuild_s, 3),
            "reload": reload_body,
            "requests": {
                "total": len(results),
                "failed": sum(1 for s, _, _ in results if s != 200),
                "by_version": {str(v): sum(1 for _, x, _ in results if x == v) for v in sorted({x for _, x, _ in results})},
                "answered_during_add": before_reload - at_add,
                "latency_s": percentiles([s for _, _, s in results]) if results else None,
            },
        }  # fmt: skip
        print(json.dumps(payload, indent=1))
        write_result("live_update", payload)
        return 0 if payload["requests"]["failed"] == 0 else 1  # type: ignore[index]
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
