"""Failing parts of the builder and the datastore (issue 8), on the real builder CLI in child processes.

- SIGKILL at random points of a build (several seeds), then the same command again: the datastore equals an
  uninterrupted build byte for byte (Lucene's BM25 segment files excepted, compared by content).
- A full disk (a real tmpfs where this process may mount one; ``RLIMIT_FSIZE``, a real EFBIG from the kernel,
  everywhere): one clear line naming the path, nothing a later run would trust, and a re-run with room
  finishes the same build.
- Unreadable, truncated or malformed corpus files: one clear line naming the file (and line), no traceback.
- A damaged datastore (truncated, corrupted, missing files, a foreign manifest): ``validate`` names the file and
  the service refuses to start.
"""

from __future__ import annotations

import bz2
import gzip
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from fastapi.testclient import TestClient

from bertknn.builder.__main__ import main
from bertknn.builder.writer import finished_shard
from bertknn.core.errors import DatastoreError, ModelLoadError
from bertknn.core.format import (
    INDEX_DIR,
    MANIFEST,
    SHARD_MARKER,
    SHARDS_DIR,
    read_manifest,
    shard_name,
    validate_datastore,
)
from bertknn.core.format.sparse import BM25_META
from bertknn.core.lucene import ready_pyserini_env
from bertknn.service.jvm import reduce_jvm_signals
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.settings import ServiceSettings
from tests.conftest import REPO, corpus_words, make_tiny_bert, write_jsonl

ARTICLES_PER_SHARD = 4
LONG_ARTICLE = 21  # in shard 5: its vectors.npy is several times any other shard file (the RLIMIT_FSIZE case)
PAGE = os.sysconf("SC_PAGE_SIZE")
BM25_DIR = f"{INDEX_DIR}/bm25"
LAST_SHARD = f"{SHARDS_DIR}/{shard_name(9)}"
BM25_QUERIES = ("painter born in", "sailor who loves boats", "the town of", "rivers and mountains")

# Run before the builder's own code in the child, then exec it: a file-size limit with SIGXFSZ ignored (so a
# write past the limit fails with EFBIG instead of killing the process), and, for root, no CAP_DAC_OVERRIDE /
# CAP_DAC_READ_SEARCH (so permission bits bind as they do for any other user). Ignored signals, rlimits and
# the capability bounding set all survive exec; doing this in a wrapper rather than a preexec_fn keeps it out
# of a parent that may run JVM and torch threads.
PRELUDE = r"""
import ctypes, os, resource, signal, sys
fsize, drop_caps, argv = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
if fsize:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
if drop_caps and os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; 24 = PR_CAPBSET_DROP
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            sys.exit(f"prelude: cannot drop capability {cap}: errno {ctypes.get_errno()}")
os.execv(sys.executable, [sys.executable, *argv])
"""


# ---- corpus, model, commands ---------------------------------------------------------------------------------


def synthetic_articles() -> list[dict]:
    """40 made-up people, 4 sentences each, one much longer (article LONG_ARTICLE): 10 shards of 4 articles."""
    rng = random.Random(7)
    syllables = ["ka", "lo", "mi", "ren", "tu", "vos", "zel", "pra", "quin", "dor", "bel", "fen"]

    def word(n: int) -> str:
        return "".join(rng.sample(syllables, n))

    names: list[str] = []
    while len(names) < 40:
        name = f"{word(2).capitalize()} {word(2).capitalize()}"
        if name not in names:
            names.append(name)
    places = sorted({word(3) for _ in range(12)})
    jobs = ["painter", "singer", "farmer", "sailor", "teacher", "writer"]
    things = ["rivers", "mountains", "bridges", "songs", "boats", "markets"]
    articles = []
    for i, name in enumerate(names):
        first = name.split()[0]
        born, moved = rng.sample(places, 2)
        sentences = [
            f"{name} was born in {born}.",
            f"{name} is a {rng.choice(jobs)} who loves {rng.choice(things)}.",
            f"Later {first} moved to the town of {moved}.",
            f"The people of {moved} remember {first} for many {rng.choice(things)}.",
        ]
        if i == LONG_ARTICLE:
            sentences += [
                f"In {rng.choice(places)} {first} painted {rng.choice(things)} and {rng.choice(things)} for a year."
                for _ in range(40)
            ]
        articles.append({"id": str(i + 1), "title": name, "text": " ".join(sentences)})
    return articles


ARTICLES = synthetic_articles()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("robust-corpus") / "people.jsonl", ARTICLES)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("robust-bert"), corpus_words(ARTICLES))


def builder_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing but the builder writes under a file-size limit
    }


def build_argv(corpus: Path, model: Path, out: Path, *, workers: int = 0, indexes: bool = True) -> list[str]:
    argv = [
        "-m", "datastore_builder", "build",
        "--corpus", str(corpus),
        "--model", str(model),
        "--out", str(out),
        "--device", "cpu",
        "--articles-per-shard", str(ARTICLES_PER_SHARD),
        "--batch-size", "32",
        "--max-seq-len", "64",
        "--threads", "1",
        "--workers", str(workers),
        # the reference forward: a fault injected here (a file-size limit) would also stop the ONNX export, which
        # auto then replaces by eager, and the build under test would not be the reference's
        "--backend", "eager",
    ]  # fmt: skip
    return argv + (["--ivfpq"] if indexes else ["--no-sparse-indexes"])


def command(argv: list[str], *, fsize: int = 0, drop_caps: bool = False) -> list[str]:
    return [sys.executable, "-c", PRELUDE, str(fsize), "1" if drop_caps else "0", *argv]


def run_builder(argv: list[str], **limits: int | bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(argv, **limits),  # type: ignore[arg-type]
        cwd=REPO,
        env=builder_env(),
        capture_output=True,  # pipes: a log file would count against the file-size limit
        text=True,
        timeout=600,
    )


def one_error_line(stderr: str) -> str:
    """The CLI's error: exactly one ``error:`` line, the last thing printed, and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == errors[0]
    return errors[0]


# ---- comparing datastores ------------------------------------------------------------------------------------


def _is_lucene_file(rel: str) -> bool:
    return rel.startswith(BM25_DIR + "/") and not rel.endswith(BM25_META)


def entries(root: Path) -> list[str]:
    """Every path under ``root`` (files, directories, FIFOs, dot files) except Lucene's own segment files."""
    return sorted(rel for p in root.rglob("*") if not _is_lucene_file(rel := p.relative_to(root).as_posix()))


def file_bytes(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in entries(root) if (root / rel).is_file()}


def debris(root: Path) -> list[str]:
    """Leftovers of an unfinished write: temp files and directories, FIFOs (every name the builder keeps is plain)."""
    return [rel for rel in entries(root) if Path(rel).name.startswith(".") or (root / rel).is_fifo()]


def bm25_content(index_dir: Path) -> tuple[list[str], dict[str, list[tuple[str, float]]]]:
    """Lucene writes random segment ids and timestamps into its files, so two identical BM25 indexes differ in
    bytes: compare what they hold (every docid) and what they answer (top hits and scores for a few queries)."""
    reduce_jvm_signals()
    ready_pyserini_env()
    from pyserini.search.lucene import LuceneSearcher

    searcher = LuceneSearcher(str(index_dir))
    try:
        docids = sorted(searcher.doc(i).docid() for i in range(searcher.num_docs))
        hits = {q: [(h.docid, round(float(h.score), 4)) for h in searcher.search(q, k=5)] for q in BM25_QUERIES}
    finally:
        searcher.close()
    return docids, hits


def assert_same_datastore(got: Path, want: Path) -> None:
    assert validate_datastore(got) == []
    assert debris(got) == []
    assert entries(got) == entries(want)
    got_bytes, want_bytes = file_bytes(got), file_bytes(want)
    assert [rel for rel in want_bytes if got_bytes[rel] != want_bytes[rel]] == []  # shards, manifest, tfidf, ivfpq
    assert bm25_content(got / BM25_DIR) == bm25_content(want / BM25_DIR)


def shard_phase_seconds(argv: list[str], out: Path, log: Path) -> float:
    """Run a build to the end; return how long it took from its first shard write to its last shard (of 10)."""
    seen: dict[str, float] = {}
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(command(argv), cwd=REPO, env=builder_env(), stdout=log_file, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            for name in (SHARDS_DIR, LAST_SHARD):
                if name not in seen and (out / name).exists():
                    seen[name] = time.monotonic()
            time.sleep(0.001)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return seen[LAST_SHARD] - seen[SHARDS_DIR]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path, model: Path) -> tuple[Path, float]:
    """An uninterrupted build with every index (BM25, TF-IDF, IVF-PQ), by the same CLI as every other build,
    and the length of its shard phase (the window the random-delay kill is drawn from)."""
    root = tmp_path_factory.mktemp("robust-reference")
    out = root / "ds"
    phase = shard_phase_seconds(build_argv(corpus, model, out), out, root / "build.log")
    m = read_manifest(out)
    assert len(m.shards) == 10 and set(m.indexes) == {"bm25", "tfidf", "ivfpq"}
    assert json.loads((out / "index" / "ivfpq.json").read_text())["plan"]["kind"] == "ivfpq"  # trained, not flat
    assert validate_datastore(out) == []
    docids, hits = bm25_content(out / BM25_DIR)
    assert len(docids) == 40 and all(hits.values())
    return out, phase


@pytest.fixture(scope="module")
def reference(reference_run: tuple[Path, float]) -> Path:
    return reference_run[0]


# ---- 1. SIGKILL at random points, then resume ----------------------------------------------------------------


Trigger = Callable[[subprocess.Popen[bytes]], str | None]


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def blocked_opening_fifo(pid: int) -> bool:
    """The process's main thread sleeps in open() on a FIFO that has no reader (it will wait there forever)."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    if wchan:
        return wchan in ("wait_for_partner", "fifo_open")
    syscall = Path(f"/proc/{pid}/syscall").read_text().split()  # where wchan is hidden: the syscall number
    return bool(syscall) and syscall[0] in ("257", "56")  # openat on x86_64, aarch64


def kill_inside_shard_temp_dir(out: Path, k: int) -> Trigger:
    def trigger(proc: subprocess.Popen[bytes]) -> str | None:
        names = _names(out / SHARDS_DIR)
        if any(n.startswith(f".tmp-{shard_name(k)}-") for n in names):
            return f"inside {shard_name(k)}'s temp dir"
        if shard_name(k) in names:  # the whole write fell between two polls: the kill lands right after it
            return f"just after {shard_name(k)} was renamed into place"
        return None

    return trigger


def kill_after_delay(out: Path, delay: float) -> Trigger:
    start: list[float] = []

    def trigger(proc: subprocess.Popen[bytes]) -> str | None:
        if not start:
            if (out / SHARDS_DIR).exists():  # the first shard is being written
                start.append(time.monotonic())
            return None
        if any(".tmp-" in n for n in _names(out / INDEX_DIR)):  # never later than the sparse indexes
            return f"sparse indexes started before {delay:.2f} s ran out"
        if time.monotonic() - start[0] >= delay:
            return f"{delay:.2f} s after the first shard write began ({len(_names(out / SHARDS_DIR))} shard entries)"
        return None

    return trigger


def kill_during_sparse_indexing(out: Path, temp_prefix: str) -> Trigger:
    def trigger(proc: subprocess.Popen[bytes]) -> str | None:
        if any(n.startswith(temp_prefix) for n in _names(out / INDEX_DIR)):
            return f"sparse indexing, once {INDEX_DIR}/{temp_prefix}* existed"
        return None

    return trigger


def kill_opening(out: Path, rel: str) -> Trigger:
    """Exactly before the builder writes ``rel``: a FIFO where its atomic write opens the temp file blocks it."""
    parent, name = (out / rel).parent, (out / rel).name
    made: list[Path] = []

    def trigger(proc: subprocess.Popen[bytes]) -> str | None:
        if not made:
            # After the resume clean-up (which runs before shards/ exists) and before the write itself.
            ready = parent.is_dir() if parent != out else (out / SHARDS_DIR).is_dir()
            if ready:
                fifo = parent / f".{name}.tmp-{proc.pid}"
                os.mkfifo(fifo)
                made.append(fifo)
            return None
        if blocked_opening_fifo(proc.pid):
            return f"just before writing {rel}"
        return None

    return trigger


def run_until(argv: list[str], trigger: Trigger, log: Path) -> tuple[int, str]:
    """Start a build in its own process group; SIGKILL the whole group (workers, the JVM) when the trigger fires."""
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            command(argv), cwd=REPO, env=builder_env(), stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        point = None
        deadline = time.monotonic() + 300  # a guard against a hang, not a timing assertion
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                point = trigger(proc)
                if point is not None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.0005)
        finally:
            if proc.poll() is None and point is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert point is not None, f"the kill point never came (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
    return proc.returncode, point


KILL_CASES = [
    # seed, kind, --workers. The seed picks the shard, the delay, the temp dir or the file (seeds chosen so that
    # the five runs kill: inside shard 2's temp dir; 46% into the shard phase; while the Lucene JVM writes;
    # while opening index/ivfpq.faiss; while opening manifest.json).
    pytest.param(1, "shard-temp-dir", 1, id="seed1-shard-temp-dir-workers1"),
    pytest.param(9, "random-delay", 0, id="seed9-random-delay-workers0"),
    pytest.param(5, "sparse-indexing", 0, id="seed5-sparse-indexing-workers0"),
    pytest.param(7, "tail-write", 1, id="seed7-tail-write-workers1"),
    pytest.param(8, "before-manifest", 0, id="seed8-before-manifest-workers0"),
]


@pytest.mark.parametrize(("seed", "kind", "workers"), KILL_CASES)
def test_sigkill_at_a_random_point_then_resume_gives_the_same_bytes(
    tmp_path: Path, corpus: Path, model: Path, reference_run: tuple[Path, float], seed: int, kind: str, workers: int
) -> None:
    reference, shard_phase = reference_run
    rng = random.Random(seed)
    out = tmp_path / "ds"
    triggers: dict[str, Callable[[], Trigger]] = {
        "shard-temp-dir": lambda: kill_inside_shard_temp_dir(out, rng.randrange(len(read_manifest(reference).shards))),
        # a random moment of the shard phase, as long as the reference build's (the time is not asserted on)
        "random-delay": lambda: kill_after_delay(out, rng.uniform(0.0, shard_phase)),
        "sparse-indexing": lambda: kill_during_sparse_indexing(out, rng.choice([".docs.tmp-", ".bm25.tmp-"])),
        "tail-write": lambda: kill_opening(out, rng.choice(["redirects.json", "index/ivfpq.faiss", "index/ivfpq.json"])),
        "before-manifest": lambda: kill_opening(out, MANIFEST),
    }
    argv = build_argv(corpus, model, out, workers=workers)
    code, point = run_until(argv, triggers[kind](), tmp_path / "killed.log")
    assert code == -signal.SIGKILL, (point, (tmp_path / "killed.log").read_text()[-3000:])
    assert not (out / MANIFEST).exists(), point
    kept = sorted(n for n in _names(out / SHARDS_DIR) if n.startswith("shard-"))
    print(f"killed {point}: {len(kept)} finished shards, debris {debris(out)}")  # shown by pytest -rA

    resumed = run_builder(argv)  # the same command
    assert resumed.returncode == 0, (point, resumed.stderr[-3000:])
    for name in kept:  # finished shards are reused, not rebuilt
        assert f"shard {name.removeprefix('shard-')} already complete, skipped (resume)" in resumed.stderr, point
    assert_same_datastore(out, reference)


# ---- 2. a full disk ------------------------------------------------------------------------------------------


def pages(root: Path) -> int:
    """Bytes the files under ``root`` take on a tmpfs (whole pages per file)."""
    return sum(math.ceil(p.stat().st_size / PAGE) * PAGE for p in root.rglob("*") if p.is_file())


class Tmpfs:
    """A real, small filesystem: a tmpfs mounted by this (root) process, resized or unmounted by it."""

    def __init__(self, mountpoint: Path):
        self.mountpoint = mountpoint
        self.mounted = False

    def mount(self, size: int) -> None:
        self.mountpoint.mkdir(exist_ok=True)
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(self.mountpoint)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}; needs root with "
                        "CAP_SYS_ADMIN): test_disk_full_file_size_limit covers a full disk without it")  # fmt: skip
        self.mounted = True

    def resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.mountpoint)], check=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)
            self.mounted = False


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    fs = Tmpfs(tmp_path / "small-disk")
    yield fs
    fs.unmount()


def assert_nothing_trusted(out: Path, *, upto: int | None = None) -> None:
    """After a failed build: no manifest, no temp dir or file left behind, and every shard directory that exists
    is complete and intact (its SHARD.json matches every file's size and sha256), as a resume will check."""
    assert not (out / MANIFEST).exists()
    assert debris(out) == []
    for name in _names(out / SHARDS_DIR):
        index = int(name.removeprefix("shard-"))
        assert finished_shard(out, index) is not None, name
        if upto is not None:
            assert index < upto, name


@pytest.mark.parametrize("phase", ["shards", "indexes"])
def test_disk_full_on_a_real_small_filesystem(
    tmpfs: Tmpfs, corpus: Path, model: Path, reference: Path, phase: str
) -> None:
    """ENOSPC from a tmpfs sized from the reference build: half its shards, or all shards and half its indexes."""
    shards = pages(reference / SHARDS_DIR)
    small_files = sum(math.ceil((reference / n).stat().st_size / PAGE) * PAGE for n in ("build.json", "redirects.json"))
    size = shards // 2 if phase == "shards" else shards + small_files + pages(reference / INDEX_DIR) // 2
    tmpfs.mount(size)
    out = tmpfs.mountpoint / "ds"
    argv = build_argv(corpus, model, out)

    failed = run_builder(argv)
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = one_error_line(failed.stderr)
    print(error)  # shown by pytest -rA
    assert error.startswith(f"error: {out}/"), error  # names the path it could not write
    assert "out of space: the disk is full (No space left on device)" in error, error
    assert "run the same command again" in error
    if phase == "shards":
        assert f"/{SHARDS_DIR}/" in error and not (out / INDEX_DIR).exists()
        assert_nothing_trusted(out, upto=10)
    else:
        assert f"/{INDEX_DIR}" in error or MANIFEST in error, error
        assert_nothing_trusted(out)
        assert len(_names(out / SHARDS_DIR)) == 10  # every shard finished before the indexes ran out of room

    tmpfs.resize(64 << 20)
    again = run_builder(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_datastore(out, reference)


def test_disk_full_file_size_limit(tmp_path: Path, corpus: Path, model: Path, reference: Path) -> None:
    """No mount needed: RLIMIT_FSIZE makes the kernel refuse (EFBIG) the long article's shard, shard 5."""
    long_shard = reference / SHARDS_DIR / shard_name(LONG_ARTICLE // ARTICLES_PER_SHARD)
    big = (long_shard / "vectors.npy").stat().st_size
    before = [p.stat().st_size for i in range(LONG_ARTICLE // ARTICLES_PER_SHARD)
              for p in (reference / SHARDS_DIR / shard_name(i)).iterdir()]  # fmt: skip
    # What the builder writes before that shard: earlier shards, build.json, the tokenizer it saves for its workers.
    others = [*before, (reference / "build.json").stat().st_size,
              *(p.stat().st_size for p in model.iterdir() if p.suffix != ".safetensors")]  # fmt: skip
    assert max(others) < big // 2, "the corpus no longer makes one shard file stand out"
    limit = big // 2

    out = tmp_path / "ds"
    argv = build_argv(corpus, model, out)
    failed = run_builder(argv, fsize=limit)
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = one_error_line(failed.stderr)
    print(error)  # shown by pytest -rA
    assert error.startswith(f"error: {out / SHARDS_DIR}/.tmp-{long_shard.name}-"), error
    assert error.split(":")[1].strip().endswith("/vectors.npy"), error
    assert "out of space: the file outgrew the file-size limit (File too large" in error, error
    assert_nothing_trusted(out, upto=LONG_ARTICLE // ARTICLES_PER_SHARD)

    again = run_builder(argv)  # the same command, with no limit
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_datastore(out, reference)


# ---- 3. unreadable and broken corpus files -------------------------------------------------------------------


def wiki_xml(articles: list[dict]) -> str:
    """A MediaWiki export with one page per line (so a page's line number is its index + 3)."""
    pages_ = [
        f"<page><title>{escape(a['title'])}</title><ns>0</ns><id>{a['id']}</id><revision><id>{a['id']}0</id>"
        f"<text xml:space=\"preserve\">{escape(a['text'])}</text></revision></page>\n"
        for a in articles
    ]
    return (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">\n'
        "<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n" + "".join(pages_) + "</mediawiki>\n"
    )


BAD = 25  # 0-based article whose record is damaged: shards 0-5 (articles 0-23) are finished before it is read


def jsonl_bytes() -> list[bytes]:
    return [(json.dumps(a, ensure_ascii=False) + "\n").encode() for a in ARTICLES]


def make_bad_corpus(directory: Path, case: str) -> tuple[Path, str]:
    """A broken corpus file and the text its error must contain (besides its path)."""
    if case == "jsonl-invalid-utf8":
        lines = jsonl_bytes()
        lines[BAD] = lines[BAD].replace(b"was born", b"was \xff\xfe born")
        path = directory / "people.jsonl"
        path.write_bytes(b"".join(lines))
        return path, f"{path}:{BAD + 1}: not valid UTF-8"
    if case == "jsonl-truncated-bz2":
        path = directory / "people.jsonl.bz2"
        data = bz2.compress(b"".join(jsonl_bytes()))
        path.write_bytes(data[: len(data) * 2 // 3])
        return path, "the compressed data is truncated or corrupt"
    if case == "xml-truncated-bz2":
        path = directory / "pages-articles.xml.bz2"
        data = bz2.compress(wiki_xml(ARTICLES).encode())
        path.write_bytes(data[: len(data) * 2 // 3])
        return path, "the compressed data is truncated or corrupt"
    xml_lines = wiki_xml(ARTICLES).encode().splitlines(keepends=True)
    line = BAD + 3  # 1-based: the root element and siteinfo come first
    if case == "xml-invalid-utf8":
        xml_lines[line - 1] = xml_lines[line - 1].replace(b"was born", b"was \xff\xfe born")
        path = directory / "pages-articles.xml"
        path.write_bytes(b"".join(xml_lines))
        return path, f"malformed XML (not well-formed (invalid token): line {line},"
    if case == "xml-mismatched-tag":
        xml_lines[line - 1] = xml_lines[line - 1].replace(b"</title>", b"</titel>")
        path = directory / "pages-articles.xml"
        path.write_bytes(b"".join(xml_lines))
        return path, f"malformed XML (mismatched tag: line {line},"
    if case == "directory":
        path = directory / "people.jsonl"
        path.mkdir()
        return path, "not a regular file"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["jsonl-invalid-utf8", "jsonl-truncated-bz2", "xml-truncated-bz2", "xml-invalid-utf8", "xml-mismatched-tag",
     "directory"],
)  # fmt: skip
def test_broken_corpus_stops_with_one_clear_line(tmp_path: Path, model: Path, case: str) -> None:
    bad, expected = make_bad_corpus(tmp_path, case)
    out = tmp_path / "ds"
    failed = run_builder(build_argv(bad, model, out, indexes=False))
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = one_error_line(failed.stderr)
    print(error)  # shown by pytest -rA
    assert error.startswith(f"error: {bad}"), error
    assert expected in error, error
    # Shards finished before the bad record are complete (and only reused by the same corpus: see below).
    assert_nothing_trusted(out)


def test_a_dump_cut_inside_a_page_builds_its_whole_pages_with_one_warning(tmp_path: Path, model: Path) -> None:
    """A truncated download: the pages before the cut are built, the cut one is not, one line says where."""
    xml = wiki_xml(ARTICLES).encode()
    cut = xml.index(b"</text>", xml.index(f"<title>{escape(ARTICLES[BAD]['title'])}</title>".encode()))
    path = tmp_path / "pages-articles.xml.gz"
    path.write_bytes(gzip.compress(xml[:cut]))
    out = tmp_path / "ds"
    done = run_builder(build_argv(path, model, out, indexes=False))
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "the dump ends inside a page" in line]
    assert len(warned) == 1 and str(path) in warned[0] and f"kept its {BAD} whole pages" in warned[0], warned
    manifest = read_manifest(out)
    assert manifest.counts.articles == BAD and manifest.warnings[0] in warned[0]
    assert validate_datastore(out) == []


def test_shards_from_a_broken_corpus_are_not_reused_for_the_repaired_one(
    tmp_path: Path, corpus: Path, model: Path
) -> None:
    bad, _ = make_bad_corpus(tmp_path, "jsonl-invalid-utf8")
    out = tmp_path / "ds"
    argv = build_argv(bad, model, out, indexes=False)
    assert run_builder(argv).returncode == 1
    assert len(_names(out / SHARDS_DIR)) == BAD // ARTICLES_PER_SHARD  # the articles before the bad line
    shutil.copyfile(corpus, bad)  # repaired in place: same path, other content
    again = run_builder(argv)
    assert again.returncode == 1
    error = one_error_line(again.stderr)
    assert f"{out} holds a build made with other settings (corpus_sha256 differ)" in error, error


def test_unreadable_corpus_file(tmp_path: Path, model: Path, corpus: Path) -> None:
    """Permission bits, really enforced: as root the child gives up CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH."""
    locked = tmp_path / "locked.jsonl"
    shutil.copyfile(corpus, locked)
    locked.chmod(0)
    probe = subprocess.run(command(["-c", f"open({str(locked)!r}, 'rb')"], drop_caps=True), capture_output=True,
                           text=True, check=False)  # fmt: skip
    if "PermissionError" not in probe.stderr:  # e.g. root without CAP_SETPCAP, which cannot drop capabilities
        pytest.skip(f"cannot make a file unreadable to a child here: {probe.stderr.strip()[-300:] or 'it read it'}")
    out = tmp_path / "ds"
    failed = run_builder(build_argv(locked, model, out), drop_caps=True)
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = one_error_line(failed.stderr)
    print(error)  # shown by pytest -rA
    assert error == f"error: {locked}: cannot be read (Permission denied); check its permissions", error
    assert "Loading weights" not in failed.stderr  # refused before the model was loaded
    assert not (out / MANIFEST).exists() and not (out / SHARDS_DIR).exists()


# ---- 4. a damaged datastore ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_model_datastore(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The same corpus and settings, another tiny BERT (seed 1): its manifest is the 'foreign' one."""
    other = make_tiny_bert(tmp_path_factory.mktemp("robust-other-bert"), corpus_words(ARTICLES), seed=1)
    out = tmp_path_factory.mktemp("robust-other") / "ds"
    done = run_builder(build_argv(corpus, other, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def damage(ds: Path, case: str, other: Path) -> tuple[str, str]:
    """Damage a copy of the reference; return the file that must be named and what must be said about it."""
    shards = ds / SHARDS_DIR
    if case == "truncated-shard-file":
        f = shards / "shard-00003" / "vectors.npy"
        f.write_bytes(f.read_bytes()[:-100])
        return str(f), "truncated or rewritten"
    if case == "corrupted-byte":
        f = shards / "shard-00004" / "vectors.npy"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit of one vector: same size, valid npy, a different float
        f.write_bytes(bytes(data))
        return str(f), "sha256 mismatch (corrupted)"
    if case == "missing-file":
        f = shards / "shard-00002" / "labels.npy"
        f.unlink()
        return str(f), "missing"
    if case == "missing-shard-dir":
        shutil.rmtree(shards / "shard-00007")
        return str(shards / "shard-00007" / SHARD_MARKER), "missing or unreadable"
    if case == "manifest-from-another-model":
        shutil.copyfile(other / MANIFEST, ds / MANIFEST)
        return str(shards / "shard-00000" / SHARD_MARKER), "differs from the manifest's entry"
    raise AssertionError(case)


DAMAGE = ["truncated-shard-file", "corrupted-byte", "missing-file", "missing-shard-dir", "manifest-from-another-model"]


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_datastore_is_reported_and_refused(
    tmp_path: Path,
    reference: Path,
    other_model_datastore: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    ds = Path(shutil.copytree(reference, tmp_path / "ds"))
    path, what = damage(ds, case, other_model_datastore)

    capsys.readouterr()
    assert main(["validate", str(ds)]) == 1
    report = capsys.readouterr().err
    first = report.splitlines()[0]
    assert first.startswith(f"INVALID: {path}: ") and what in first, report

    # Sizes and shapes (the quick start-up check) cannot see a flipped bit: only the full hashes can, which the
    # service computes at start-up with verify_checksums (BERTKNN_VERIFY_CHECKSUMS).
    verify = case == "corrupted-byte"
    with pytest.raises((DatastoreError, ModelLoadError)) as err:
        AnswerPipeline.open(ds, device="cpu", verify_checksums=verify)
    print(f"validate: {first}\nservice: {err.value}")  # shown by pytest -rA
    assert path in str(err.value) or "model" in str(err.value), err.value
    if verify:
        assert f"{path}: sha256 mismatch" in str(err.value)


def test_service_setting_verify_checksums_refuses_a_corrupted_byte(
    tmp_path: Path, reference: Path, other_model_datastore: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = Path(shutil.copytree(reference, tmp_path / "ds"))
    path, _ = damage(ds, "corrupted-byte", other_model_datastore)
    monkeypatch.setenv("BERTKNN_VERIFY_CHECKSUMS", "true")
    settings = ServiceSettings(datastore=ds, model={"device": "cpu"})  # type: ignore[arg-type]
    assert settings.verify_checksums
    with pytest.raises(DatastoreError, match=re.escape(f"{path}: sha256 mismatch")), TestClient(create_app(settings)):
        pass
