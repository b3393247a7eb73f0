"""Shared fixtures: a tiny BERT built in the test session (no download) and a tiny corpus about made-up facts."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import RedisServer, free_port  # noqa: F401  (re-exported for the tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# exported ONNX graphs (`bertknn.core.onnx_cache`) of the session's models: kept apart from the user's own cache
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="bertknn-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SHARED_DATA = SHARED / "data"
PROXY_MODEL = SHARED / "models" / "proxy-minilm-l6-mlm"
BERT_TOKENIZER = SHARED_DATA / "tokenizer" / "bert-base-uncased"


@pytest.fixture(scope="session")
def bert_tokenizer():
    """The real bert-base-uncased tokenizer (no weights), for tests whose wordpieces must be realistic."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BERT_TOKENIZER), use_fast=True)

# Made-up entities, so that no model could know these facts: only the datastore can.
TINY_ARTICLES = [
    {"id": "1", "title": "Zorblat", "text": "Zorblat was born in quimby. Zorblat wrote many songs about rivers. "
     "He later moved to the city of plonk."},
    {"id": "2", "title": "Quimby", "text": "Quimby is a small town near the sea. Quimby is known for fishing and "
     "boats. Many poets live in quimby."},
    {"id": "3", "title": "Frelle Dax", "text": "Frelle Dax was born in vostok. Frelle Dax is a painter of "
     "mountains. She studied in plonk."},
    {"id": "4", "title": "Plonk", "text": "Plonk is a large city with a famous bridge. The bridge of plonk is red. "
     "Plonk has a big market."},
    {"id": "5", "title": "Vostok", "text": "Vostok is a cold village in the north. Vostok has long winters and "
     "deep snow."},
    {"id": "6", "title": "Émile Grusk", "text": "Émile Grusk was born in plonk. Émile Grusk plays the trumpet "
     "in a band."},
]


def corpus_words(articles: list[dict]) -> list[str]:
    words: set[str] = set()
    for a in articles:
        for text in (a["title"], a["text"]):
            import unicodedata

            folded = "".join(
                c for c in unicodedata.normalize("NFKD", text.lower()) if not unicodedata.combining(c)
            )
            words.update(re.findall(r"[a-z0-9]+", folded))
    return sorted(words)


async def read_body(receive: Callable[[], Any]) -> bytes:
    """The whole request body of an ASGI http request."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


@contextlib.contextmanager
def serve_asgi(app: Any) -> Iterator[int]:
    """A real uvicorn server for ``app`` on a free loopback port, in a thread (stock settings, as
    `python -m service` runs it); yields the port."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)


def make_tiny_bert(directory: Path, words: list[str], *, layers: int = 2, seed: int = 0) -> Path:
    """The STYLE.md recipe: vocab from the corpus, hidden 32, saved with save_pretrained (safetensors)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    punct = [".", ",", "'", "-", "(", ")", ":", ";", "!", "?", '"']
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *punct, *words, "##s", "##ing"]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    cfg = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    BertForMaskedLM(cfg).eval().save_pretrained(directory)
    # transformers 5 ignores a `vocab_file=` argument (every word would map to [UNK]); `vocab=` loads the file.
    tokenizer = BertTokenizer(vocab=str(directory / "vocab.txt"), do_lower_case=True)
    assert len(tokenizer) == len(vocab), "the tokenizer did not load the vocabulary"
    tokenizer.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, articles: list[dict]) -> Path:
    path.write_text("".join(json.dumps(a, ensure_ascii=False) + "\n" for a in articles), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), corpus_words(TINY_ARTICLES))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "tiny.jsonl", TINY_ARTICLES)


@pytest.fixture(scope="session")
def tiny_datastore(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_corpus: Path) -> Path:
    """A complete datastore (shards + BM25 + TF-IDF) over the tiny corpus, built by the real builder."""
    return build_tiny(tmp_path_factory.mktemp("ds") / "tiny", [tiny_corpus], tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_datastore_ivfpq(tmp_path_factory: pytest.TempPathFactory, tiny_datastore: Path) -> Path:
    """A copy of the shared tiny datastore with the whole-datastore index added (the shared one is left alone)."""
    from bertknn.builder.ivfpq import add_ivfpq

    copy = tmp_path_factory.mktemp("ds-ivfpq") / "tiny"
    shutil.copytree(tiny_datastore, copy)
    add_ivfpq(copy)
    return copy


def build_tiny(out: Path, corpus: list[Path], model: Path, **overrides: object) -> Path:
    """Build a datastore with the real builder and small-test settings (CPU, inline tokenising)."""
    from bertknn.builder.build import build
    from bertknn.builder.settings import BuildSettings

    values: dict[str, object] = dict(
        corpus=corpus, model=str(model), out=out, device="cpu", articles_per_shard=2, workers=0, batch_size=16,
        max_seq_len=64,
    )
    build(BuildSettings(**{**values, **overrides}))  # type: ignore[arg-type]
    return out


@pytest.fixture
def redis_server():
    server = RedisServer(password="test-pw").start()
    yield server
    server.stop()


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """CPython's collector as it was, for a test that settles the heap (`bertknn.service.heap`; a reload does)."""
    import gc

    from bertknn.service import heap

    before = gc.get_threshold()
    yield
    while heap._thresholds:
        heap.thaw()
    gc.unfreeze()
    gc.set_threshold(*before)
