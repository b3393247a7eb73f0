"""The quick start's demo questions, answered from the bundled sample with the proxy model, as the script asks them.

With the subject rule only the subject's own article is searched, so a datastore of those articles (taken from
``data/sample_wiki.jsonl``) answers exactly as the quick start's 300-article one does.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from tests.conftest import PROXY_MODEL, build_tiny

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample_wiki.jsonl"
QUICKSTART = REPO / "scripts" / "quickstart.sh"
GOLD = {"Galileo Galilei": "pisa", "Marie Curie": "physics"}


def demo_questions() -> list[tuple[str, str]]:
    """The (text, subject) of every `bert-knn predict` line of the quick start."""
    out = []
    for line in QUICKSTART.read_text().splitlines():
        if line.startswith("bert-knn predict "):
            args = shlex.split(line)
            out.append((args[2], args[args.index("--subject") + 1]))
    return out


@pytest.fixture(scope="module")
def sample_pipeline(tmp_path_factory: pytest.TempPathFactory) -> AnswerPipeline:
    subjects = {s for _, s in demo_questions()}
    corpus = tmp_path_factory.mktemp("sample") / "demo.jsonl"
    with open(SAMPLE, encoding="utf-8") as src, open(corpus, "w", encoding="utf-8") as dst:
        dst.writelines(line for line in src if json.loads(line)["title"] in subjects)
    # the quick start's own settings (the builder's defaults), so that contexts are windowed alike
    ds = build_tiny(tmp_path_factory.mktemp("ds") / "demo", [corpus], PROXY_MODEL, max_seq_len=128, articles_per_shard=500)
    return AnswerPipeline.open(ds, device="cpu")


def test_the_quick_start_asks_the_demo_questions() -> None:
    assert [s for _, s in demo_questions()] == list(GOLD)
    assert not re.search(r"albert einstein was born in", QUICKSTART.read_text())  # the sample cannot answer it
    from urllib.parse import urlencode

    text, subject = demo_questions()[0]
    link = "/ui?" + urlencode({"text": text, "subject": subject})  # the playground, asking the first one
    assert link in QUICKSTART.read_text()


@pytest.mark.parametrize(("text", "subject"), demo_questions())
def test_each_demo_question_is_answered_and_knn_fixes_the_mlm(sample_pipeline: AnswerPipeline, text: str, subject: str) -> None:
    answer = sample_pipeline.predict(Query(text=text, subject=subject, top_k=3))
    assert answer.articles[0].title == subject and answer.subject_status == "found"
    assert answer.predictions[0].token == GOLD[subject]
    assert answer.predictions[0].contexts and subject in answer.predictions[0].contexts[0].article
    assert answer.mlm[0].token != GOLD[subject]  # the masked LM alone gets it wrong: the datastore is what helps


def test_the_quick_start_refuses_a_busy_port_before_building(tmp_path: Path) -> None:
    """Another server on the port must not answer the demo questions in the quick start's place."""
    import os
    import socket
    import subprocess

    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        env = {**os.environ, "BERTKNN_PORT": str(port), "QUICKSTART_OUT": str(tmp_path / "ds"),
               "BERTKNN_MODEL": str(PROXY_MODEL)}  # fmt: skip
        run = subprocess.run(["bash", str(QUICKSTART)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"quickstart: port {port} is in use" in run.stderr
    assert not (tmp_path / "ds").exists()  # nothing was built
