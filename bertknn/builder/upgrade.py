"""``upgrade``: convert a datastore of an older format version to the current one, in place.

Version 1 and 2 datastores hold everything version 3 needs except the files readers now open instead of loading:
the article table (written from the shards' ``articles.json`` and ``redirects.json``; the last occurrence of a
title is live, as the old reader decided) and the TF-IDF index as plain memory-mappable arrays (rewritten from
``postings.npz`` and ``titles.json``). Shards are not touched, so the datastore id stays. The manifest is
rewritten last, atomically: an interrupted upgrade leaves the old version readable and is simply run again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bertknn.builder.writer import write_table
from bertknn.core.errors import DatastoreError
from bertknn.core.format import (
    ARTICLE_TABLE,
    FORMAT_VERSION,
    MANIFEST,
    REDIRECTS,
    UPGRADABLE_FORMAT_VERSIONS,
    atomic_write_json,
    read_manifest,
    validate_datastore,
    write_manifest,
)
from bertknn.core.format.sparse import (
    SPARSE_FORMAT_VERSION,
    TFIDF_PARAMS,
    TFIDF_V1_POSTINGS,
    write_tfidf_arrays,
)

logger = logging.getLogger(__name__)


def upgrade_datastore(root: Path) -> dict[str, object]:
    """Convert ``root`` to the current format version; a summary of what was done. DatastoreError says why not."""
    root = Path(root)
    t0 = time.perf_counter()
    manifest = read_manifest(root)
    if manifest.format_version == FORMAT_VERSION:
        return {"datastore": str(root), "from_version": FORMAT_VERSION, "changed": False}
    if manifest.format_version not in UPGRADABLE_FORMAT_VERSIONS:
        raise DatastoreError(
            f"{root / MANIFEST}: format version {manifest.format_version} cannot be converted (this code converts "
            f"{UPGRADABLE_FORMAT_VERSIONS}); rebuild the datastore"
        )
    before = manifest.format_version
    redirects_path = root / REDIRECTS
    redirects = json.loads(redirects_path.read_text(encoding="utf-8")) if redirects_path.is_file() else {}
    write_table(root, manifest, sorted(redirects.items()), ARTICLE_TABLE)
    converted = []
    tfidf = manifest.indexes.get("tfidf")
    if tfidf is not None and (root / tfidf / TFIDF_V1_POSTINGS).is_file():
        _upgrade_tfidf(root / tfidf)
        converted.append(tfidf)
    manifest.format_version = FORMAT_VERSION
    problems = validate_datastore(root, hashes=False, manifest=manifest)
    if problems:
        raise DatastoreError(f"{root}: the converted datastore fails validation, nothing was committed: {problems[0]}")
    write_manifest(root, manifest)
    summary = {
        "datastore": str(root),
        "from_version": before,
        "to_version": FORMAT_VERSION,
        "changed": True,
        "article_table": manifest.article_table,
        "tfidf_converted": converted,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    logger.info("upgrade finished: %s", json.dumps(summary))
    return summary


def _upgrade_tfidf(directory: Path) -> None:
    """``postings.npz`` + ``titles.json`` -> the version 2 arrays (the old files stay until the manifest moves on:
    the version 1 reader of a running service keeps working)."""
    params = json.loads((directory / TFIDF_PARAMS).read_text(encoding="utf-8"))
    titles = json.loads((directory / "titles.json").read_text(encoding="utf-8"))
    postings = sp.csr_array(sp.load_npz(directory / TFIDF_V1_POSTINGS))
    if postings.shape[1] != len(titles):
        raise DatastoreError(f"{directory}: {len(titles)} titles for {postings.shape[1]} postings columns; rebuild it")
    write_tfidf_arrays(directory, titles, sp.csr_array(postings, dtype=np.float32))
    atomic_write_json(directory / TFIDF_PARAMS, {**params, "version": SPARSE_FORMAT_VERSION})
