"""The benchmark corpus: Wikipedia articles plus, for T-REx, the probe's evidence sentences as subject articles.

One JSON line per article (``{"id", "title", "text"}``), the builder's JSONL input:

- ``wiki/vital_articles.jsonl`` (Wikipedia lead sections) and ``wiki/google_re_articles.jsonl`` (the Wikipedia
  snippets behind the Google-RE facts, titled by their URL);
- for T-REx, every evidence sentence of the probe (``masked_sentence`` with ``[MASK]`` replaced by ``obj_surface``,
  i.e. the Wikipedia sentence that states the fact), grouped into one article per subject, titled with the
  subject label, sentences in file order, duplicates dropped (a subset caps the sentences of facts it does not
  evaluate, see `trex_evidence_articles`).

Titles are compared after ``normalize_title`` (the builder keeps the first article of a title and drops the
others), so an evidence article whose subject already has a Wikipedia article is appended to that article.

A subset (the default of the benchmark) keeps the subject articles of the evaluated facts only, plus a fixed
sample of the vital articles as distractors for the article ranker: the first ``distractors`` by sha256 of the
title, a deterministic sample independent of file order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from bertknn.core.text import MASK_RE
from bertknn.core.titles import normalize_title

logger = logging.getLogger(__name__)

_SPACES = re.compile(r"\s+")


@dataclass
class CorpusStats:
    articles: int = 0
    sentences_added: int = 0
    chars: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    merged_titles: int = 0

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def _jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def evidence_sentence(evidence: dict) -> str | None:
    """A T-REx evidence's Wikipedia sentence: its masked sentence with the object's surface form put back."""
    found = evidence_span(evidence)
    return found[0] if found is not None else None


def evidence_span(evidence: dict) -> tuple[str, int, int] | None:
    """`evidence_sentence` and the character span of the object's surface form in it (the first [MASK]'s)."""
    masked, surface = evidence.get("masked_sentence"), evidence.get("obj_surface")
    if not isinstance(masked, str) or not isinstance(surface, str) or not MASK_RE.search(masked):
        return None
    marked = MASK_RE.sub(lambda _: f"\ue000{surface}\ue001", masked, count=1)
    marked = MASK_RE.sub(lambda _: surface, marked)
    # collapse whitespace as evidence_sentence always has, the two marks being of no width
    out: list[str] = []
    marks: list[int] = []
    for ch in marked:
        if ch in "\ue000\ue001":
            marks.append(len(out))
        elif ch.isspace():
            if out and out[-1] != " ":
                out.append(" ")
        else:
            out.append(ch)
    text = "".join(out).rstrip()
    if not text or len(marks) != 2:
        return None
    start, end = (min(m, len(text)) for m in marks)
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return text, start, end


def trex_evidence_articles(
    trex_dir: Path,
    subjects: set[str] | None = None,
    *,
    keep_uids: set[str] | None = None,
    max_fact_sentences: int | None = None,
    max_other_sentences: int | None = None,
    links: dict[str, tuple[int, int, str]] | None = None,
) -> dict[str, list[str]]:
    """Subject label -> its evidence sentences over every T-REx relation file (all subjects when None).

    ``links``: filled with sentence -> (start, end, object title): the object's surface form in the sentence,
    linked to the article titled with the object's label (the first fact a sentence states).

    The sentences of the facts in ``keep_uids`` come first (at most ``max_fact_sentences`` per fact); at most
    ``max_other_sentences`` sentences of other facts follow (None: no cap). A few subjects are heavy-tailed
    (one fact about Germany has ~2,800 evidences), and the caps keep a subset benchmark's datastore proportional
    to its number of facts.
    """
    first: dict[str, list[str]] = {}
    other: dict[str, list[str]] = {}
    seen: dict[str, set[str]] = {}
    for path in sorted(trex_dir.glob("P*.jsonl")):
        for fact in _jsonl(path):
            subject = fact.get("sub_label")
            if not isinstance(subject, str) or not subject.strip():
                continue
            if subjects is not None and subject not in subjects:
                continue
            evaluated = keep_uids is not None and str(fact.get("uuid")) in keep_uids
            bucket = first if evaluated else other
            taken = 0
            obj = fact.get("obj_label")
            for ev in fact.get("evidences") or []:
                if evaluated and max_fact_sentences is not None and taken >= max_fact_sentences:
                    break
                found = evidence_span(ev)
                sentence = found[0] if found is not None else None
                if sentence is None or sentence in seen.setdefault(subject, set()):
                    continue
                if links is not None and found is not None and isinstance(obj, str) and found[2] > found[1]:
                    links.setdefault(sentence, (found[1], found[2], normalize_title(obj)))
                seen[subject].add(sentence)
                bucket.setdefault(subject, []).append(sentence)
                taken += 1
    out: dict[str, list[str]] = {}
    for subject in [*first, *(s for s in other if s not in first)]:
        extra = other.get(subject, [])
        if max_other_sentences is not None:
            extra = extra[:max_other_sentences]
        out[subject] = first.get(subject, []) + extra
    return out


def google_re_titles(google_re_dir: Path, uids: set[str] | None = None) -> set[str]:
    """Normalised titles of the Wikipedia articles behind the given Google-RE facts (their evidence URLs)."""
    titles: set[str] = set()
    for path in sorted(google_re_dir.glob("*_test.jsonl")):
        for fact in _jsonl(path):
            if uids is not None and str(fact.get("uuid")) not in uids:
                continue
            for ev in fact.get("evidences") or []:
                url = ev.get("url")
                if isinstance(url, str) and "/wiki/" in url:
                    titles.add(normalize_title(unquote(url.rsplit("/wiki/", 1)[1])))
    return titles


def sample_by_hash(articles: Iterable[dict], n: int | None) -> list[dict]:
    """The first ``n`` articles by sha256 of their title (all, in file order, when ``n`` is None)."""
    items = list(articles)
    if n is None:
        return items
    keyed = sorted(items, key=lambda a: hashlib.sha256(str(a["title"]).encode("utf-8")).hexdigest())
    chosen = {id(a) for a in keyed[:n]}
    return [a for a in items if id(a) in chosen]


class _Merged:
    """The corpus's articles by normalised title: a title seen again gets the new text appended (its links'
    offsets shifted)."""

    def __init__(self, stats: CorpusStats):
        self.stats = stats
        self.articles: dict[str, dict] = {}

    def add(self, source: str, title: str, text: str, art_id: str, spans: list[dict] | None = None) -> None:
        key = normalize_title(title)
        if not key or not text.strip():
            return
        if key in self.articles:
            shift = len(self.articles[key]["text"]) + 1
            self.articles[key]["text"] += "\n" + text
            self.stats.merged_titles += 1
        else:
            shift = 0
            self.articles[key] = {"id": art_id, "title": key, "text": text}
        if spans:
            self.articles[key].setdefault("links", []).extend(
                {**ln, "start": ln["start"] + shift, "end": ln["end"] + shift} for ln in spans
            )
        self.stats.by_source[source] = self.stats.by_source.get(source, 0) + 1

    def write(self, out: Path) -> None:
        """The articles as JSON lines, written to a temporary file first."""
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for art in self.articles.values():
                f.write(json.dumps(art, ensure_ascii=False) + "\n")
                self.stats.chars += len(art["text"])
        tmp.replace(out)
        self.stats.articles = len(self.articles)


def _link_spans(subject: str, sentences: list[str], sentence_links: dict[str, tuple[int, int, str]] | None) -> list[dict]:
    """The links of a subject's evidence sentences as offsets into their text joined by newlines (a link to the
    subject itself left out)."""
    spans: list[dict] = []
    offset = 0
    for sentence in sentences:
        link = sentence_links.get(sentence) if sentence_links is not None else None
        if link is not None and link[2] != normalize_title(subject):
            spans.append({"start": offset + link[0], "end": offset + link[1], "target": link[2]})
        offset += len(sentence) + 1
    return spans


def write_corpus(
    out: Path,
    *,
    wiki_dir: Path,
    lama_dir: Path,
    trex_subjects: set[str] | None,
    trex_uids: set[str] | None,
    google_re_uids: set[str] | None,
    distractors: int | None,
    max_fact_sentences: int | None = None,
    max_other_sentences: int | None = None,
    links: bool = False,
) -> CorpusStats:
    """Write the benchmark corpus to ``out``; ``None`` for a selection means everything.

    ``links``: each T-REx evidence sentence links its object's surface form to the object's title (``"links"``
    in the JSON lines: character offsets into ``text``), as Wikipedia's own link there would."""
    stats = CorpusStats()
    merged = _Merged(stats)
    sentence_links: dict[str, tuple[int, int, str]] | None = {} if links else None
    for art in sample_by_hash(_jsonl(wiki_dir / "vital_articles.jsonl"), distractors):
        merged.add("vital", art["title"], art["text"], f"vital-{art['id']}")
    wanted = None if google_re_uids is None else google_re_titles(lama_dir / "Google_RE", google_re_uids)
    for art in _jsonl(wiki_dir / "google_re_articles.jsonl"):
        if wanted is None or normalize_title(art["title"]) in wanted:
            merged.add("google_re", art["title"], art["text"], str(art["id"]))
    evidence = trex_evidence_articles(
        lama_dir / "TREx",
        trex_subjects,
        keep_uids=trex_uids,
        max_fact_sentences=max_fact_sentences,
        max_other_sentences=max_other_sentences,
        links=sentence_links,
    )
    for i, (subject, sentences) in enumerate(evidence.items()):
        stats.sentences_added += len(sentences)
        spans = _link_spans(subject, sentences, sentence_links)
        merged.add("trex_evidence", subject, "\n".join(sentences), f"trex-{i}", spans)
    merged.write(out)
    logger.info("corpus %s: %s", out, json.dumps(stats.as_dict()))
    return stats
