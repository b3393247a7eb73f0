"""``upgrade``: a datastore of format version 1 (articles loaded from every shard's ``articles.json``, TF-IDF in
``postings.npz``) is refused with the command that converts it, and the converted one answers as before.

The version-1 datastore is made from a fresh build by undoing exactly what version 3 added: the manifest loses its
article table and says version 1, the table file goes, and the TF-IDF index is written back in version 1's files
(``scipy.sparse.save_npz`` and ``titles.json``), which is how the builder wrote them before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from fastapi.testclient import TestClient

from bertknn.builder.__main__ import main
from bertknn.builder.upgrade import upgrade_datastore
from bertknn.core.errors import DatastoreError
from bertknn.core.format import MANIFEST, Datastore, read_manifest, validate_datastore
from bertknn.core.format.sparse import (
    SPARSE_FORMAT_VERSION,
    TFIDF_DATA,
    TFIDF_FILES,
    TFIDF_INDICES,
    TFIDF_INDPTR,
    TFIDF_PARAMS,
    TFIDF_TITLE_OFFSETS,
    TFIDF_TITLES,
)
from bertknn.service.main import create_app
from bertknn.service.retrieval.sparse import TfidfRetriever
from bertknn.service.settings import ServiceSettings


def as_version_1(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    table = manifest.pop("article_table")
    (dst / table).unlink()
    manifest["format_version"] = 1
    for shard in manifest["shards"]:
        shard.pop("part", None)
        shard.pop("last", None)
    manifest.pop("contexts_per_shard", None)
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=1))
    tfidf = dst / manifest["indexes"]["tfidf"]
    offsets = np.load(tfidf / TFIDF_TITLE_OFFSETS)
    blob = (tfidf / TFIDF_TITLES).read_bytes()
    titles = [blob[offsets[i] : offsets[i + 1]].decode() for i in range(len(offsets) - 1)]
    indptr, indices, data = (np.load(tfidf / n) for n in (TFIDF_INDPTR, TFIDF_INDICES, TFIDF_DATA))
    postings = sp.csr_array((data, indices, indptr), shape=(len(indptr) - 1, len(titles)))
    sp.save_npz(tfidf / "postings.npz", sp.csr_matrix(postings), compressed=False)
    (tfidf / "titles.json").write_text(json.dumps(titles, ensure_ascii=False))
    for name in TFIDF_FILES:
        if name not in ("buckets.npy", "idf.npy"):
            (tfidf / name).unlink()
    params = json.loads((tfidf / TFIDF_PARAMS).read_text())
    (tfidf / TFIDF_PARAMS).write_text(json.dumps({**params, "version": 1}))
    return dst


@pytest.fixture()
def old_datastore(tmp_path: Path, tiny_datastore: Path) -> Path:
    return as_version_1(tiny_datastore, tmp_path / "v1")


def test_an_old_datastore_is_refused_naming_the_converter(old_datastore: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(DatastoreError, match=f"bert-knn upgrade {old_datastore}"):
        Datastore(old_datastore)
    problems = validate_datastore(old_datastore)
    assert len(problems) == 1 and "format version 1" in problems[0] and "upgrade" in problems[0]
    # the service says the same in one line at start-up
    with pytest.raises(Exception, match="upgrade"), TestClient(
        create_app(ServiceSettings(datastore=old_datastore, model={"device": "cpu"}))
    ):
        pass


def test_upgrade_converts_in_place_and_answers_as_before(
    old_datastore: Path, tiny_datastore: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before_id = json.loads((old_datastore / MANIFEST).read_text())["datastore_id"]
    assert main(["upgrade", str(old_datastore)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["from_version"] == 1 and summary["changed"] and summary["tfidf_converted"] == ["index/tfidf"]
    assert validate_datastore(old_datastore) == []
    m = read_manifest(old_datastore)
    assert m.datastore_id == before_id and m.article_table == "articles.sqlite"
    assert json.loads((old_datastore / "index/tfidf" / TFIDF_PARAMS).read_text())["version"] == SPARSE_FORMAT_VERSION

    new, ref = Datastore(old_datastore), Datastore(tiny_datastore)
    assert sorted(new.articles) == sorted(ref.articles)
    assert all(new.articles[t] == ref.articles[t] for t in ref.articles)
    assert dict(new.redirects.items()) == dict(ref.redirects.items())
    a, b = TfidfRetriever(old_datastore / "index/tfidf"), TfidfRetriever(tiny_datastore / "index/tfidf")
    for q in ("zorblat was born in [MASK] .", "the capital city", "river"):
        assert a.top_articles(q, 3) == b.top_articles(q, 3)
    # a second run has nothing to do
    assert upgrade_datastore(old_datastore)["changed"] is False
    with TestClient(create_app(ServiceSettings(datastore=old_datastore, model={"device": "cpu"}))) as c:
        got = c.post("/predict", json={"text": "zorblat was born in [MASK] .", "retriever": "tfidf"})
        assert got.status_code == 200, got.text
    with TestClient(create_app(ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}))) as c:
        want = c.post("/predict", json={"text": "zorblat was born in [MASK] .", "retriever": "tfidf"})
    assert [p["token"] for p in got.json()["predictions"]] == [p["token"] for p in want.json()["predictions"]]
