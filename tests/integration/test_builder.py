"""The builder end to end on real Wikipedia text.

A tiny BERT with the real bert-base-uncased vocabulary (so real text tokenises as it would for bert-base)
builds datastores from a JSONL slice of ../shared/data/wiki and from an XML dump written here. The tests check
that they validate, that every row lines up with its sentence, word and label and re-encodes to its vector, that
a build killed with SIGKILL resumes to the same bytes as a clean build, and that slices built by separate
workers merge into the same bytes as one build.
"""

from __future__ import annotations

import bz2
import json
import logging
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    PreTrainedTokenizerBase,
)

from bertknn.builder.__main__ import main
from bertknn.builder.build import build
from bertknn.builder.corpus import CorpusStats, read_corpora
from bertknn.builder.embed import CARRIED
from bertknn.builder.merge import merge_slices
from bertknn.builder.sentences import SentenceSplitter
from bertknn.builder.settings import BuildSettings
from bertknn.builder.targets import TargetSelector, load_stopwords, masked_ids
from bertknn.builder.wikitext import sentence_problem
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import BuildError, MergeError
from bertknn.core.format import (
    MANIFEST,
    REDIRECTS,
    SHARDS_DIR,
    Datastore,
    read_manifest,
    validate_datastore,
)
from bertknn.service.retrieval.sparse import TfidfRetriever

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
VITAL = SHARED_DATA / "wiki" / "vital_articles.jsonl"
BERT_TOKENIZER = SHARED_DATA / "tokenizer" / "bert-base-uncased"
MIN_SENTENCE_CHARS = 10  # BuildSettings' default


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Builds set torch's global thread count; give the rest of the session its own back."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bert_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """STYLE.md's tiny BERT (hidden 32, 2 layers), but with the real 30,522-entry bert-base-uncased tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-bert-real-vocab")
    tokenizer = AutoTokenizer.from_pretrained(str(BERT_TOKENIZER), use_fast=True)
    cfg = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    BertForMaskedLM(cfg).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(bert_vocab_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(bert_vocab_model), use_fast=True)


def vital_slice(path: Path, start: int, stop: int) -> Path:
    with open(VITAL, encoding="utf-8") as f:
        lines = [line for i, line in enumerate(f) if start <= i < stop]
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def vital30(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vital_slice(tmp_path_factory.mktemp("corpus") / "vital30.jsonl", 0, 30)


@pytest.fixture(scope="module")
def vital120(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vital_slice(tmp_path_factory.mktemp("corpus") / "vital120.jsonl", 0, 120)


def settings(corpus: list[Path], model: Path, out: Path, **overrides: object) -> BuildSettings:
    values: dict[str, object] = dict(
        corpus=corpus,
        model=str(model),
        out=out,
        device="cpu",
        workers=0,
        threads=1,
        batch_size=32,
        articles_per_shard=8,
        sparse_indexes=False,  # the BM25/TF-IDF indexes are another module's, tested there
    )
    values.update(overrides)
    return BuildSettings(**values)  # type: ignore[arg-type]


# ---- alignment ----------------------------------------------------------------------------------------------


def check_alignment(root: Path, corpus: list[Path], tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> int:
    """Every article's rows against the corpus, re-derived independently; vectors of sampled rows re-encoded.

    Returns the number of rows checked against a direct forward pass.
    """
    store = Datastore(root)
    texts: dict[str, str] = {}
    for art in read_corpora(corpus, CorpusStats()):
        texts.setdefault(art.title, art.text)  # first title wins, as in the build
    assert set(store.articles) <= set(texts)
    splitter = SentenceSplitter()
    selector = TargetSelector(tokenizer, load_stopwords())
    for title, entry in store.articles.items():
        shard = store.shards[entry.shard]
        sentences = [shard.sentence(i) for i in range(entry.sent_start, entry.sent_end)]
        want = [s for s in splitter.split(texts[title]) if len(s) >= MIN_SENTENCE_CHARS and sentence_problem(s) is None]
        assert sentences == want, title
        rows = range(entry.row_start, entry.row_end)
        expected = [
            (entry.sent_start + k, t.token_id, t.char_start, t.char_end)
            for k, ts in enumerate(selector.select(sentences))
            for t in ts.targets
        ]
        got = [
            (int(shard.sentence_ids[r]), int(shard.labels[r]), int(shard.spans[r][0]), int(shard.spans[r][1])) for r in rows
        ]
        assert got == expected, title
        for sid, label, a, b in got:
            word = shard.sentence(sid)[a:b]
            assert tokenizer(word, add_special_tokens=False)["input_ids"] == [label], (title, word)

    # Vectors: hidden_states[manifest.layer] at the mask, computed with plain transformers on one unpadded sentence.
    model = AutoModelForMaskedLM.from_pretrained(str(model_dir)).eval()
    encoder = MaskedLMEncoder.load(str(model_dir), device="cpu", dtype="float32", max_seq_len=store.manifest.max_seq_len)
    assert encoder.layer == store.manifest.layer == 1  # -2 of a 2-layer model
    rng = random.Random(0)
    checked = 0
    for g in rng.sample(range(store.total_rows), min(60, store.total_rows)):
        pos, row = store.locate(g)
        shard = store.shards[pos]
        sentence = shard.sentence(int(shard.sentence_ids[row]))
        (ts,) = selector.select([sentence])
        target = next(t for t in ts.targets if (t.char_start, t.char_end) == tuple(shard.spans[row]))
        ids, mask_pos = masked_ids(ts, target, tokenizer.mask_token_id)
        stored = shard.vectors[row].astype(np.float32)
        fresh = encoder.encode([encoder.masked_input(ids, mask_pos)]).embeddings[0]
        np.testing.assert_allclose(stored, fresh, rtol=2e-3, atol=2e-3)
        if len(ids) + 2 <= store.manifest.max_seq_len:  # no window: the direct input is the whole sentence
            with torch.no_grad():
                out = model(input_ids=torch.tensor([[tokenizer.cls_token_id, *ids, tokenizer.sep_token_id]]),
                            output_hidden_states=True)
            direct = out.hidden_states[store.manifest.layer][0, mask_pos + 1].numpy()
            np.testing.assert_allclose(stored, direct, rtol=2e-3, atol=2e-3)
            checked += 1
    return checked


@pytest.fixture(scope="module")
def jsonl_store(tmp_path_factory: pytest.TempPathFactory, bert_vocab_model: Path, vital30: Path) -> Path:
    out = tmp_path_factory.mktemp("jsonl") / "ds"
    with torch_threads(1):
        build(settings([vital30], bert_vocab_model, out, backend="eager"))  # the reference forward
    return out


def test_jsonl_build_validates(jsonl_store: Path) -> None:
    assert validate_datastore(jsonl_store) == []
    m = read_manifest(jsonl_store)
    assert m.counts.articles == 30
    assert len(m.shards) == 4  # 30 articles, 8 per shard
    assert m.counts.contexts == sum(s.rows for s in m.shards) > 1000
    assert m.layer == 1 and m.dtype == "float16" and m.slice is None
    assert [(s.path, s.format) for s in m.sources] == [("vital30.jsonl", "jsonl")]


def test_jsonl_rows_align_with_sentences_labels_and_vectors(
    jsonl_store: Path, vital30: Path, tokenizer: PreTrainedTokenizerBase, bert_vocab_model: Path
) -> None:
    assert check_alignment(jsonl_store, [vital30], tokenizer, bert_vocab_model) >= 40


def test_onnx_backend_build_matches_the_eager_one_and_is_recorded(
    jsonl_store: Path, vital30: Path, tokenizer: PreTrainedTokenizerBase, bert_vocab_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "onnx"
    with torch_threads(1):
        build(settings([vital30], bert_vocab_model, out))  # the default on a CPU: auto, that is onnx
    assert validate_datastore(out) == []
    assert json.loads((out / "build.json").read_text())["backend"] == "onnx"
    assert "backend" not in json.loads((jsonl_store / "build.json").read_text())  # eager: unrecorded
    # every stored vector against the model computed directly, as for the eager build
    assert check_alignment(out, [vital30], tokenizer, bert_vocab_model) >= 40
    # the same rows, labels and sentences as the eager build; vectors equal to float16 storage precision
    onnx_store, eager_store = Datastore(out), Datastore(jsonl_store)
    assert onnx_store.manifest.counts == eager_store.manifest.counts
    for a, b in zip(onnx_store.shards, eager_store.shards, strict=True):
        np.testing.assert_array_equal(np.asarray(a.labels), np.asarray(b.labels))
        np.testing.assert_allclose(np.asarray(a.vectors, np.float32), np.asarray(b.vectors, np.float32),
                                   rtol=2e-3, atol=2e-3)
    # a resumed build does not mix backends
    with torch_threads(1), pytest.raises(BuildError, match="backend"):
        build(settings([vital30], bert_vocab_model, out, backend="eager"))


# ---- XML dump -----------------------------------------------------------------------------------------------


def wiki_page(title: str, text: str, page_id: int, *, redirect: str | None = None) -> str:
    redirect_el = f"<redirect title={quoteattr(redirect)} />" if redirect else ""
    return (
        f"<page><title>{escape(title)}</title><ns>0</ns><id>{page_id}</id>{redirect_el}<revision><id>{page_id}0</id>"
        f'<text xml:space="preserve">{escape(text)}</text></revision></page>\n'
    )


def as_wikitext(title: str, text: str) -> str:
    """A lead section dressed in the markup a real dump has around it."""
    first, _, rest = text.partition(" ")
    return (
        f"{{{{Short description|{title}}}}}\n{{{{Infobox thing|name={title}}}}}\n"
        f"'''{first}''' {rest}<ref>{{{{cite web|title=Source}}}}</ref>\n"
        f"[[File:{title}.jpg|thumb|A picture of [[{title}]]]]\n[[Category:{title}]]\n"
    )


@pytest.fixture(scope="module")
def xml_dump(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    with open(VITAL, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(36), f, strict=False)][30:36]
    pages = [wiki_page(r["title"], as_wikitext(r["title"], r["text"]), 100 + i) for i, r in enumerate(rows)]
    pages += [
        wiki_page("Numero zero", "#REDIRECT [[0]]", 200, redirect="0"),
        wiki_page("Mercury", "'''Mercury''' may refer to:\n* [[Mercury (planet)]]\n{{Disambiguation}}", 201),
        wiki_page("List of numbers", "This is a list of numbers such as one and two.", 202),
    ]
    xml = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">\n'
        "<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n" + "".join(pages) + "</mediawiki>\n"
    )
    path = tmp_path_factory.mktemp("xml") / "enwiki-20240101-pages-articles1.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode("utf-8")))
    return path, [r["title"] for r in rows]


def test_xml_dump_and_jsonl_build_together(
    tmp_path: Path,
    bert_vocab_model: Path,
    tokenizer: PreTrainedTokenizerBase,
    xml_dump: tuple[Path, list[str]],
) -> None:
    dump_path, xml_titles = xml_dump
    jsonl = vital_slice(tmp_path / "first3.jsonl", 0, 3)
    # The dump repeats the JSONL's first title: the first corpus wins, the repeat is counted.
    with open(VITAL, encoding="utf-8") as f:
        first = json.loads(f.readline())
    dump_with_dupe = tmp_path / "enwiki-dupe-pages-articles.xml.bz2"
    xml = bz2.decompress(dump_path.read_bytes()).decode()
    xml = xml.replace("</mediawiki>", wiki_page(first["title"], "A different text about zero. It is long enough.", 300)
                      + "</mediawiki>")
    dump_with_dupe.write_bytes(bz2.compress(xml.encode()))
    out = tmp_path / "ds"
    with torch_threads(1):
        m = build(settings([jsonl, dump_with_dupe], bert_vocab_model, out, articles_per_shard=4))
    assert validate_datastore(out) == []
    store = Datastore(out)
    with open(VITAL, encoding="utf-8") as f:
        jsonl_titles = [json.loads(line)["title"] for _, line in zip(range(3), f, strict=False)]
    assert sorted(store.articles) == sorted(jsonl_titles + xml_titles)
    assert m.counts.skipped_duplicate_titles == 1
    assert m.counts.skipped_pages == 2  # the disambiguation page and the list page
    assert json.loads((out / REDIRECTS).read_text()) == {"Numero zero": "0"}
    assert [s.format for s in m.sources] == ["jsonl", "mediawiki-xml"]
    for title in xml_titles:
        text = " ".join(s for s in (store.shards[store.articles[title].shard].sentence(i)
                                    for i in range(store.articles[title].sent_start, store.articles[title].sent_end)))
        assert text
        for residue in ("[[", "{{", "'''", "<ref", "cite web", "thumb", "Category:", "Infobox"):
            assert residue not in text, (title, residue)
    assert check_alignment(out, [jsonl, dump_with_dupe], tokenizer, bert_vocab_model) >= 20


# ---- kill and resume ----------------------------------------------------------------------------------------


def cli_args(corpus: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "build",
        "--corpus", str(corpus),
        "--model", str(model),
        "--out", str(out),
        "--device", "cpu",
        "--articles-per-shard", "2",
        "--batch-size", "32",
        "--threads", "1",
        "--no-sparse-indexes",
        *extra,
    ]  # fmt: skip


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, bert_vocab_model: Path, vital120: Path) -> Path:
    """An uninterrupted build (in this process, tokenising inline: --workers 0)."""
    out = tmp_path_factory.mktemp("reference") / "ds"
    with torch_threads(1):
        assert main(cli_args(vital120, bert_vocab_model, out, "--workers", "0")) == 0
    assert validate_datastore(out) == []
    assert len(read_manifest(out).shards) == 60
    return out


def test_sigkilled_build_resumes_to_the_same_bytes(
    tmp_path: Path, bert_vocab_model: Path, vital120: Path, reference: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "killed"
    # The default path: a worker process splits and tokenises ahead of the model.
    argv = cli_args(vital120, bert_vocab_model, out, "--workers", "1")
    command = [sys.executable, "-m", "datastore_builder", *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "killed.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        first_shard = out / SHARDS_DIR / "shard-00000"
        deadline = time.monotonic() + 300
        while proc.poll() is None and not first_shard.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the builder and its tokenising worker, as a pod kill would
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the build was not killed midway:\n{log.read_text()[-3000:]}"
    assert not (out / MANIFEST).exists()
    done = sorted(p.name for p in (out / SHARDS_DIR).glob("shard-*"))
    assert 1 <= len(done) < 60, done
    first_inode = (first_shard / "vectors.npy").stat().st_ino
    # Debris of the kind a crash leaves: an unfinished temp dir, which must never be trusted.
    (out / SHARDS_DIR / ".tmp-shard-00059-999999").mkdir()
    (out / SHARDS_DIR / ".tmp-shard-00059-999999" / "vectors.npy").write_bytes(b"partial")

    # Resuming with different settings is refused, naming what differs.
    capsys.readouterr()
    assert main(cli_args(vital120, bert_vocab_model, out, "--workers", "0", "--layer", "-1")) == 1
    err = capsys.readouterr().err
    assert "holds a build made with other settings" in err and "layer" in err
    assert main([*cli_args(vital120, bert_vocab_model, out, "--workers", "0"), "--articles-per-shard", "3"]) == 1
    assert "articles_per_shard" in capsys.readouterr().err

    # The same command again finishes the build.
    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "shard 00000 already complete, skipped (resume)" in resumed.stderr
    assert (first_shard / "vectors.npy").stat().st_ino == first_inode  # kept, not rebuilt
    assert not list((out / SHARDS_DIR).glob(".tmp-*"))

    assert validate_datastore(out) == []
    got, want = tree_bytes(out / SHARDS_DIR), tree_bytes(reference / SHARDS_DIR)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
    assert (out / MANIFEST).read_bytes() == (reference / MANIFEST).read_bytes()
    assert (out / REDIRECTS).read_bytes() == (reference / REDIRECTS).read_bytes()


def _rows(root: Path) -> tuple[np.ndarray, list[str], np.ndarray]:
    """A datastore's rows in order, whatever its parts: labels, the sentence of each row, and the vectors."""
    store = Datastore(root)
    labels, sentences, vectors = [], [], []
    for shard in store.shards:
        labels.append(np.asarray(shard.labels))
        sentences += [shard.sentence(int(i)) for i in shard.sentence_ids]
        vectors.append(np.asarray(shard.vectors, dtype=np.float32))
    return np.concatenate(labels), sentences, np.concatenate(vectors)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_the_work_says_how_to_resume_and_the_resume_gives_the_same_rows(
    tmp_path: Path, bert_vocab_model: Path, vital120: Path, reference: Path
) -> None:
    out = tmp_path / "stopped"
    # blocks of 30 articles (a few thousand contexts each), kept every 64 contexts: the interrupt lands inside a part
    # (the eager forward one context at a time, so that the tiny model's build lasts seconds after its first part)
    argv = [*cli_args(vital120, bert_vocab_model, out, "--workers", "1"), "--articles-per-shard", "30",
            "--checkpoint-contexts", "64", "--batch-size", "1", "--backend", "eager"]  # fmt: skip
    command = [sys.executable, "-m", "datastore_builder", *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Ctrl-C as a terminal delivers it: a runner that starts the suite in the background (`cmd &` in a script)
    # hands its children SIGINT ignored, which a real Ctrl-C never meets
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)  # fmt: skip
    first = out / SHARDS_DIR / "shard-00000"
    deadline = time.monotonic() + 300
    while proc.poll() is None and not first.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # into the next block's part
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group: the builder and its worker
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped: {out} keeps ") and "Resume it with the same command: " in last, last
    resume = shlex.split(last.split("Resume it with the same command: ", 1)[1])
    assert resume == ["python", "-m", "datastore_builder", *argv]
    kept = [json.loads((p / "SHARD.json").read_text()) for p in sorted((out / SHARDS_DIR).glob("shard-*"))]
    assert kept and not (out / MANIFEST).exists()

    done = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert validate_datastore(out) == []
    got, want = _rows(out), _rows(reference)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]
    np.testing.assert_allclose(got[2], want[2], rtol=2e-3, atol=2e-3)  # float16 rounding of other batches
    assert read_manifest(out).counts.contexts == read_manifest(reference).counts.contexts


def test_an_interrupt_inside_a_part_writes_the_articles_embedded_so_far(
    tmp_path: Path, bert_vocab_model: Path, vital120: Path, reference: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C at a known point: 1,500 contexts into a one-block build (about 4,800 contexts in one part). The
    articles embedded whole are written; the rows past them are kept aside and taken up by the resume."""
    from bertknn.builder.progress import BuildProgress

    real = BuildProgress.embedded
    at_interrupt: list[int] = []

    def embedded(self: BuildProgress, rows: int) -> None:
        real(self, rows)
        if self.contexts >= 1500:
            at_interrupt.append(self.contexts)
            raise KeyboardInterrupt  # as SIGINT does, inside the forward loop

    out = tmp_path / "ds"
    argv = [*cli_args(vital120, bert_vocab_model, out, "--workers", "0"), "--articles-per-shard", "120",
            "--checkpoint-contexts", "256"]  # fmt: skip
    monkeypatch.setattr(BuildProgress, "embedded", embedded)
    with torch_threads(1):
        assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    (part,) = [json.loads((p / "SHARD.json").read_text()) for p in (out / SHARDS_DIR).glob("shard-*")]
    assert not part["last"] and 0 < part["articles"] < 120 and 1500 - 256 - 200 < part["rows"] <= 1500, part
    # the rows embedded past the last whole article (whole steps of 256) are kept aside for the resume
    with np.load(out / CARRIED) as kept:
        aside = len(kept["vectors"])
    assert aside > 0 and (part["rows"] + aside) % 256 == 0 and part["rows"] + aside <= at_interrupt[0], (part, aside)
    assert "keeps 1 finished parts" in err, err
    assert f"; {aside:,} contexts of the articles cut short kept aside for it" in err, err
    assert "at most 256 contexts of work in flight were lost" in err, err
    monkeypatch.setattr(BuildProgress, "embedded", real)
    caplog.set_level(logging.INFO, logger="bertknn.builder.embed")
    with torch_threads(1):
        assert main(argv) == 0  # the same command resumes after the part, taking up the rows kept aside
    assert f"{aside} contexts embedded before the interruption taken up again" in caplog.text
    assert not (out / CARRIED).exists()
    got, want = _rows(out), _rows(reference)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]
    np.testing.assert_allclose(got[2], want[2], rtol=2e-3, atol=2e-3)


def test_rows_kept_aside_go_only_to_a_part_that_starts_with_their_inputs(tmp_path: Path) -> None:
    from bertknn.builder.embed import save_carried, take_carried
    from bertknn.core.inputs import MaskedInput, PackedInputs

    inputs = PackedInputs.of([MaskedInput((101, 5, 103, 102), 2), MaskedInput((101, 103, 7, 8, 102), 1),
                              MaskedInput((101, 9, 103, 102), 2)])  # fmt: skip
    vectors = np.arange(2 * 4, dtype=np.float16).reshape(2, 4)
    assert take_carried(tmp_path, inputs) is None  # nothing kept
    save_carried(tmp_path, inputs[:2], vectors)
    np.testing.assert_array_equal(take_carried(tmp_path, inputs), vectors)  # the same first two inputs
    np.testing.assert_array_equal(take_carried(tmp_path, inputs[:2]), vectors)
    assert take_carried(tmp_path, inputs[1:]) is None  # another start
    assert take_carried(tmp_path, inputs[:1]) is None  # fewer rows than were kept
    other = PackedInputs.of([MaskedInput((101, 5, 103, 102), 1), MaskedInput((101, 103, 7, 8, 102), 1)])
    assert take_carried(tmp_path, other) is None  # the same ids, another mask position
    (tmp_path / CARRIED).write_bytes(b"not an npz")
    assert take_carried(tmp_path, inputs) is None  # unreadable: embedded again


# ---- parallel slices and merge -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slices(tmp_path_factory: pytest.TempPathFactory, bert_vocab_model: Path, vital120: Path) -> list[Path]:
    root = tmp_path_factory.mktemp("slices")
    outs = []
    with torch_threads(1):
        for i in range(2):
            out = root / f"slice{i}"
            argv = cli_args(vital120, bert_vocab_model, out, "--workers", "0", "--shard-index", str(i), "--num-shards", "2")
            assert main(argv) == 0
            outs.append(out)
    return outs


def test_slices_hold_alternate_shards(slices: list[Path]) -> None:
    for i, s in enumerate(slices):
        m = read_manifest(s)
        assert m.slice is not None and (m.slice.index, m.slice.count) == (i, 2)
        assert [info.index for info in m.shards] == list(range(i, 60, 2))
        assert validate_datastore(s) == []


def test_merged_slices_equal_a_single_build(slices: list[Path], reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    m = merge_slices(list(reversed(slices)), out, sparse_indexes=False)
    assert validate_datastore(out) == []
    assert m.slice is None and m.counts == read_manifest(reference).counts
    got, want = tree_bytes(out / SHARDS_DIR), tree_bytes(reference / SHARDS_DIR)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
    assert (out / MANIFEST).read_bytes() == (reference / MANIFEST).read_bytes()
    assert (out / REDIRECTS).read_bytes() == (reference / REDIRECTS).read_bytes()
    # Same filesystem: the shard files are hard links, not copies.
    assert (out / SHARDS_DIR / "shard-00001" / "vectors.npy").stat().st_ino == (
        slices[1] / SHARDS_DIR / "shard-00001" / "vectors.npy"
    ).stat().st_ino


def test_interrupted_merge_resumes(slices: list[Path], reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    merge_slices(slices, out, sparse_indexes=False)
    # As if killed before the manifest: one shard not yet in place, another half-copied in a temp dir.
    (out / MANIFEST).unlink()
    shutil.rmtree(out / SHARDS_DIR / "shard-00004")
    partial = out / SHARDS_DIR / ".tmp-shard-00004-999999"
    partial.mkdir()
    (partial / "vectors.npy").write_bytes(b"partial")
    merge_slices(slices, out, sparse_indexes=False)
    assert validate_datastore(out) == []
    assert not list((out / SHARDS_DIR).glob(".tmp-*"))
    assert (out / MANIFEST).read_bytes() == (reference / MANIFEST).read_bytes()
    assert tree_bytes(out / SHARDS_DIR) == tree_bytes(reference / SHARDS_DIR)


def test_merge_refuses_an_out_of_other_files_and_leaves_it_alone(
    slices: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A merge never mixes its files into someone else's: refused before a shard is taken, nothing written."""
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "photos").mkdir()
    with pytest.raises(MergeError, match=r"holds files that are not a datastore's \(notes\.txt, photos\)"):
        merge_slices(slices, out, sparse_indexes=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "photos"]
    assert main(["merge", *map(str, slices), "--out", str(out), "--no-sparse-indexes"]) == 1
    assert "merge into a new or empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "photos"]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(MergeError, match="a file, not a directory"):
        merge_slices(slices, a_file, sparse_indexes=False)
    volume = tmp_path / "volume"  # a mounted volume's root: taken
    (volume / "lost+found").mkdir(parents=True)
    merge_slices(slices, volume, sparse_indexes=False)
    assert validate_datastore(volume) == []


def test_cli_merge_with_indexes(
    slices: list[Path], reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI merge also builds the BM25, TF-IDF and IVF-PQ indexes (through build._build_indexes)."""
    out = tmp_path / "merged"
    assert main(["merge", *map(str, slices), "--out", str(out), "--ivfpq"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["id"] == read_manifest(reference).datastore_id
    assert main(["validate", str(out)]) == 0
    m = read_manifest(out)
    assert m.indexes == {"bm25": "index/bm25", "tfidf": "index/tfidf", "ivfpq": "index/ivfpq.faiss"}
    want = read_manifest(reference).model_dump(exclude={"indexes"})
    assert m.model_dump(exclude={"indexes"}) == want
    tfidf = TfidfRetriever(out / "index" / "tfidf")
    assert sorted(tfidf.titles()) == sorted(Datastore(out).articles)
    # A finished merge is not overwritten.
    assert main(["merge", *map(str, slices), "--out", str(out), "--no-sparse-indexes"]) == 1
    assert "already holds a finished datastore" in capsys.readouterr().err


def edit_manifest(root: Path, **changes: object) -> None:
    data = json.loads((root / MANIFEST).read_text())
    data.update(changes)
    (root / MANIFEST).write_text(json.dumps(data))


def test_merge_refuses_slices_that_do_not_belong_together(slices: list[Path], reference: Path, tmp_path: Path) -> None:
    with pytest.raises(MergeError, match=r"slices \[1\] of 2 are missing"):
        merge_slices([slices[0]], tmp_path / "a", sparse_indexes=False)
    with pytest.raises(MergeError, match="both slice 0 of 2"):
        merge_slices([slices[0], slices[0], slices[1]], tmp_path / "b", sparse_indexes=False)
    with pytest.raises(MergeError, match="not a slice"):
        merge_slices([slices[0], reference], tmp_path / "c", sparse_indexes=False)

    other = Path(shutil.copytree(slices[1], tmp_path / "other-layer"))
    edit_manifest(other, layer=2)
    with pytest.raises(MergeError, match=r"other-layer: layer is 2, but .*slice0 has 1"):
        merge_slices([slices[0], other], tmp_path / "d", sparse_indexes=False)

    settings_differ = Path(shutil.copytree(slices[1], tmp_path / "other-limit"))
    state = json.loads((settings_differ / "build.json").read_text())
    (settings_differ / "build.json").write_text(json.dumps({**state, "limit_articles": 100}))
    with pytest.raises(MergeError, match=r"limit_articles differ"):
        merge_slices([slices[0], settings_differ], tmp_path / "e", sparse_indexes=False)

    gap = Path(shutil.copytree(slices[1], tmp_path / "gap"))
    data = json.loads((gap / MANIFEST).read_text())
    data["shards"] = [s for s in data["shards"] if s["index"] != 7]
    (gap / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(MergeError, match=r"missing \[7\]"):
        merge_slices([slices[0], gap], tmp_path / "f", sparse_indexes=False)

    corrupt = Path(shutil.copytree(slices[1], tmp_path / "corrupt"))
    vectors = corrupt / SHARDS_DIR / "shard-00003" / "vectors.npy"
    data_bytes = bytearray(vectors.read_bytes())
    data_bytes[-1] ^= 0xFF
    vectors.write_bytes(bytes(data_bytes))
    with pytest.raises(MergeError, match=r"shard-00003/vectors\.npy: sha256 mismatch"):
        merge_slices([slices[0], corrupt], tmp_path / "g", sparse_indexes=False)
    assert not (tmp_path / "g" / MANIFEST).exists()


# ---- CLI errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--shard-index", "3", "--num-shards", "2"], 2, "--shard-index 3 must be < --num-shards 2"),
        (["--batch-size", "0"], 2, "--batch-size"),
        (["--corpus", "{tmp}/absent.jsonl"], 1, "absent.jsonl: no such corpus file"),
        (["--corpus", "{tmp}/notes.txt"], 1, "notes.txt: unknown corpus format"),
    ],
)
def test_cli_build_refuses_bad_flags_naming_the_problem(
    tmp_path: Path, vital30: Path, capsys: pytest.CaptureFixture[str], extra: list[str], code: int, message: str
) -> None:
    (tmp_path / "notes.txt").write_text("not a corpus")
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    argv = ["build", "--out", str(tmp_path / "ds"), "--device", "cpu"]
    argv += extra if "--corpus" in extra else ["--corpus", str(vital30), *extra]
    assert main(argv) == code
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ds" / MANIFEST).exists()


def test_cli_merge_of_an_unfinished_slice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s0").mkdir()
    assert main(["merge", str(tmp_path / "s0"), "--out", str(tmp_path / "m")]) == 1
    assert "no manifest" in capsys.readouterr().err
