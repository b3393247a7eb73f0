"""A datastore of Wikipedia's shape at 50,000 articles (``python -m bench.scale synth``) passes ``validate`` and is
served: start-up reads no article list, subject lookup works by exact title, folded title and redirect, and BM25
retrieves from it. (The full-shape figures come from ``python -m bench.scale run``; see docs/performance.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bertknn.core.format import Datastore, read_manifest, validate_datastore
from bertknn.core.format.reader import Shard
from bertknn.core.titles import fold_title
from bertknn.service.main import create_app
from bertknn.service.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wiki_shaped(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("scale") / "ds"
    cmd = [sys.executable, "-m", "bench.scale", "synth", "--articles", "50000", "--redirects", "80000",
           "--contexts", "300000", "--model", str(tiny_model_dir), "--out", str(out),
           "--articles-per-shard", "5000", "--contexts-per-shard", "20000"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_synthetic_datastore_is_valid_and_wikipedia_shaped(wiki_shaped: Path) -> None:
    assert validate_datastore(wiki_shaped) == []
    m = read_manifest(wiki_shaped)
    assert m.counts.articles == 50_000 and m.counts.contexts == 300_000
    assert len({s.index for s in m.shards}) == 10 and len(m.shards) > 10  # blocks of 5,000, cut into parts
    ds = Datastore(wiki_shaped)
    assert len(ds.articles) == 50_000 and len(ds.redirects) == 80_000
    rows = sorted(e.rows for e in ds.table.live())
    assert rows[-1] >= 2_000 and rows[len(rows) // 2] <= 10  # a long tail: a few huge articles, most small
    folded: dict[str, int] = {}
    for title in ds.articles:
        folded[fold_title(title)] = folded.get(fold_title(title), 0) + 1
    assert sum(1 for n in folded.values() if n > 1) >= 100  # case and accent collisions to resolve


def test_the_service_serves_it_without_loading_the_article_list(
    wiki_shaped: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = Datastore(wiki_shaped)
    live = [e for e in ds.table.live() if e.rows > 0]
    subject = next(e.title for e in live[1000:] if " " in e.title and e.title.lower() != e.title)
    redirect = next(s for s in ds.redirects if ds.redirects[s] in ds.articles and ds.articles[ds.redirects[s]].rows)
    ds.close()

    def refuse(self: Shard) -> list[dict]:
        raise AssertionError(f"{self.dir}: articles.json read while serving")

    monkeypatch.setattr(Shard, "articles", refuse)  # start-up and queries use the article table only
    with TestClient(create_app(ServiceSettings(datastore=wiki_shaped, model={"device": "cpu"}))) as c:
        assert c.get("/readyz").status_code == 200
        got = c.post("/predict", json={"text": f"{subject} is a [MASK] .", "subject": subject}).json()
        assert got["subject_status"] == "found" and [a["title"] for a in got["articles"]] == [subject]
        assert got["predictions"] and got["predictions"][0]["contexts"]
        folded = c.post("/predict", json={"text": "it is a [MASK] .", "subject": subject.lower()}).json()
        # "Xxx yyy" may itself be a redirect of the dump (tried before folding); either way it is the subject's article
        assert folded["subject_status"] in ("folded", "redirect") and folded["articles"][0]["title"] == subject
        via = c.post("/predict", json={"text": "it is a [MASK] .", "subject": redirect}).json()
        assert via["subject_status"] == "redirect" and via["articles"][0]["title"] == ds.redirects[redirect]
        bm25 = c.post("/predict", json={"text": f"{subject} is a [MASK] .", "retriever": "bm25"}).json()
        assert subject in [a["title"] for a in bm25["articles"]], json.dumps(bm25)[:500]
