"""A datastore per language from real Wikipedia dumps, and the checks that say whether it can answer::

    python -m bench.languages [--languages ja,uk,vi] [--probe 200] [--vocab 6000] [--tokenizer DIR]

For each of ``../shared/data/wiki-i18n``'s dumps (Japanese, Ukrainian, Vietnamese ``pages-articles`` XML, cut
short after 100,000 lines), a tiny XLM-R-style model is made whose Unigram tokenizer is trained on that dump's own
article text (`tests/support/families.py`), and the dump is built with the builder's defaults: no language flag.
Then, per language, measured on the datastore:

- the build's warnings (the truncated end must be one of them), and pages stored that the dump marks as another
  namespace or a redirect (read from the raw XML here, not by the builder's reader);
- of the stored sentences: markup residue (``[[``, ``{{``, ``|``, ``<ref``, ``=``-headings, file-link parameters
  such as ``thumb`` or ``300px``), fragments (under 3 words; under 6 letters for unspaced scripts), and the
  sentences dropped against kept;
- of the stored contexts: the share that are word targets, and word targets with punctuation attached; the rows
  labelled with a link's target (``manifest.links``: a link whose anchor cuts a word is none);
- of the stored sentences' words that could be targets (neither stopwords nor punctuation), the share kept as
  targets by the model's own tokenizer and by each ``--tokenizer`` (bert-base-uncased's by default): what the
  build's warning of a tokenizer that barely knows the language counts;
- the self-probe (`bertknn.evaluation.selfprobe`): the masked word at rank 1 from the kNN alone with the subject,
  and the own article in BM25's top 3 without it; subjects written with another first-letter case or Unicode form.

The model is random, so these figures measure the language rules, not answer quality. Prints a table and writes
``bench/results/languages.json``.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import lzma
import random
import re
import shutil
import time
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RUNS, SHARED, machine, write_result

DUMPS = SHARED / "data" / "wiki-i18n"
RESIDUE = re.compile(
    r"\[\[|\]\]|\{\{|\}\}|\||<ref|</ref|^=+|=+$|\b(thumb|thumbnail|mini|miniatur|upright|left|right)\b\s*\||\d+px\b"
    r"|サムネイル|мініатюра|міні\||nhỏ\|"
)
_LETTER_WORD = re.compile(r"[^\W\d_]+")


def dump_of(language: str) -> Path:
    return DUMPS / f"{language}wiki-truncated-100k.xml.xz"


def other_pages(dump: Path) -> set[str]:
    """Titles the raw XML marks as another namespace (``<ns>`` not 0) or as a redirect (``<redirect``)."""
    raw = dump.read_bytes()
    text = (lzma.decompress(raw) if dump.suffix == ".xz" else raw).decode("utf-8")
    out = set()
    for page in re.findall(r"<page>(.*?)</page>", text, re.S):
        title = re.search(r"<title>(.*?)</title>", page, re.S)
        ns = re.search(r"<ns>(-?\d+)</ns>", page)
        if title and ((ns and ns.group(1) != "0") or "<redirect" in page):
            out.add(unicodedata.normalize("NFC", html.unescape(title.group(1))).replace("_", " "))
    return out


def make_model(language: str, work: Path, vocab: int) -> Path:
    """A tiny XLM-R-style masked LM whose tokenizer is trained on the dump's article text (kept between runs)."""
    from bertknn.builder.corpus import CorpusStats, read_corpora
    from tests.support.families import make_family_model, train_tokenizer

    model = work / f"model-v{vocab}"
    if (model / "config.json").is_file():
        return model
    texts = [a.text for a in read_corpora([dump_of(language)], CorpusStats())]
    tokenizer = train_tokenizer("xlm-roberta", texts, vocab_size=vocab)
    return make_family_model(model, "xlm-roberta", texts, tokenizer=tokenizer, positions=256)


def build(language: str, model: Path, out: Path, reuse: bool = False) -> tuple[Any, float | None]:
    from bertknn.builder.build import build as run_build
    from bertknn.builder.settings import BuildSettings
    from bertknn.core.format import read_manifest

    if reuse and (out / "manifest.json").is_file():
        return read_manifest(out), None
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    manifest = run_build(BuildSettings(corpus=[dump_of(language)], model=str(model), out=out))
    return manifest, time.perf_counter() - t0


def _unspaced(text: str) -> bool:
    from bertknn.core.languages import unspaced_share

    return unspaced_share(text) > 0.5


def is_fragment(sentence: str) -> bool:
    if _unspaced(sentence):
        return sum(1 for ch in sentence if unicodedata.category(ch)[0] == "L") < 6
    return len(_LETTER_WORD.findall(sentence)) < 3


def text_checks(out: Path, manifest: Any, others: set[str], tokenizers: dict[str, Path]) -> dict[str, Any]:
    """The stored sentences' and contexts' shares (module docstring); the words kept by each of ``tokenizers``
    (`word_share`, by name)."""
    from bertknn.core.format.reader import Datastore
    from bertknn.core.text import is_word_break

    ds = Datastore(out, manifest)
    sentences: list[str] = []
    words = rows = glued = 0
    titles = []
    for shard in ds.shards:
        sentences += [shard.sentence(i) for i in range(len(shard.sentence_offsets) - 1)]
        titles += [a["title"] for a in shard.articles()]
        labels, spans, sids = np.asarray(shard.labels), np.asarray(shard.spans), np.asarray(shard.sentence_ids)
        rows += len(labels)
        for r in np.flatnonzero(labels >= 0):
            words += 1
            word = shard.sentence(int(sids[r]))[spans[r][0] : spans[r][1]]
            glued += bool(is_word_break(word[:1]) or is_word_break(word[-1:]))
    dropped = manifest.counts.dropped_sentences
    kept = len(sentences)
    out_sents = [s for s in sentences if s.rstrip("」』）)\"'”").endswith(("。", "！", "？", ".", "!", "?"))]
    return {
        "articles": len(titles),
        "other_pages_stored": sorted(set(titles) & others)[:10],
        "sentences": kept,
        "residue": sum(bool(RESIDUE.search(s)) for s in sentences) / max(1, kept),
        "residue_examples": [s for s in sentences if RESIDUE.search(s)][:3],
        "fragments": sum(map(is_fragment, sentences)) / max(1, kept),
        "dropped": sum(dropped.values()) / max(1, kept + sum(dropped.values())),
        "dropped_by_reason": dropped,
        "ends_with_stop": len(out_sents) / max(1, kept),
        "contexts": rows,
        "word_targets": words / max(1, rows),
        "punctuation_attached": glued,
        "links": None if manifest.links is None else manifest.links.model_dump(),
        "words_kept": {name: word_share(sentences, path, manifest.language) for name, path in tokenizers.items()},
    }


def word_share(sentences: list[str], tokenizer: Path | str, language: str) -> float | None:
    """Of the sentences' words that could be targets (neither stopwords nor punctuation), the share that this
    tokenizer's single-piece rule keeps: what the build counts for its vocabulary warning
    (`bertknn.core.format.health.vocabulary_warning`), here for any tokenizer, the model's or another's."""
    from transformers import AutoTokenizer

    from bertknn.builder.targets import TargetSelector, load_stopwords

    selector = TargetSelector(AutoTokenizer.from_pretrained(str(tokenizer), use_fast=True), load_stopwords(None, language))
    seen = kept = 0
    for i in range(0, len(sentences), 256):
        for sent in selector.select(sentences[i : i + 256]):
            seen += sent.words
            kept += sent.word_targets
    return kept / seen if seen else None


def subject_forms(pipeline: Any, titles: list[str], n: int = 50, seed: int = 0) -> float | None:
    """Subjects written with the other first-letter case, or in NFD: the share still found as their article."""
    from bertknn.service.results import Query

    rng = random.Random(seed)
    variants = []
    for t in rng.sample(titles, min(len(titles), 4 * n)):
        flipped = t[0].lower() + t[1:] if t[0].isupper() else t
        form = unicodedata.normalize("NFD", flipped)
        if form != t:
            variants.append((t, form))
    variants = variants[:n]
    if not variants:
        return None
    found = 0
    for title, form in variants:
        hits, _ = pipeline.articles.retrieve(Query(text="[MASK] .", subject=form, retriever="bm25", num_articles=1))
        found += bool(hits) and hits[0].title == title and hits[0].rule == "subject"
    return found / len(variants)


def one_language(language: str, args: argparse.Namespace) -> dict[str, Any]:
    from bertknn.evaluation.common import open_pipeline
    from bertknn.evaluation.selfprobe import self_probe

    work = args.work / language
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(language, work, args.vocab)
    manifest, seconds = build(language, model, work / "datastore", args.reuse)
    row: dict[str, Any] = {
        "language": manifest.language, "build_s": None if seconds is None else round(seconds, 1),
        "warnings": manifest.warnings,
        "truncation_warned": sum("ends inside a page" in w for w in manifest.warnings) == 1,
        **text_checks(work / "datastore", manifest, other_pages(dump_of(language)),
                      {"its model's": model, **{p.name: p for p in args.tokenizer}}),
    }  # fmt: skip
    pipeline = open_pipeline(work / "datastore", model=None, device="cpu", threads=1, cache_items=1 << 12)
    try:
        probe = self_probe(pipeline, args.probe, retriever="bm25", num_articles=3)
        titles = [a["title"] for s in pipeline.datastore.shards for a in s.articles()]
        row.update(self_probe=probe.report(), subject_forms=subject_forms(pipeline, titles))
    finally:
        pipeline.close()
    return row


TARGETS = (
    ("truncation_warned", "truncated end warned once", lambda v: v is True),
    ("other_pages_stored", "other namespace / redirect pages stored", lambda v: not v),
    ("residue", "markup residue (< 0.5%)", lambda v: v < 0.005),
    ("fragments", "fragments (< 2%)", lambda v: v < 0.02),
    ("dropped", "sentences dropped", None),
    ("word_targets", "word targets among contexts", None),
    ("punctuation_attached", "word targets with punctuation attached", lambda v: v == 0),
)


def table(rows: list[dict[str, Any]]) -> str:
    langs = [r["language"] for r in rows]
    lines = ["| check | " + " | ".join(langs) + " |", "|---|" + "---:|" * len(langs)]

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2%}" if v < 0.01 else f"{v:.1%}"
        if isinstance(v, list):
            return str(len(v))
        return str(v)

    for key, label, _ in TARGETS:
        lines.append(f"| {label} | " + " | ".join(cell(r[key]) for r in rows) + " |")
    lines.append("| rows with a link's target | "
                 + " | ".join(cell((r["links"] or {}).get("mentions")) for r in rows) + " |")  # fmt: skip
    lines.append("| self-probe: word at rank 1, kNN alone, subject given | "
                 + " | ".join(cell(r["self_probe"]["knn_top1"]) for r in rows) + " |")  # fmt: skip
    lines.append("| self-probe: own article in BM25 top 3, no subject | "
                 + " | ".join(cell(r["self_probe"]["retrieval_top"]) for r in rows) + " |")  # fmt: skip
    for name in rows[0]["words_kept"]:
        lines.append(f"| words kept as targets, {name} tokenizer | "
                     + " | ".join(cell(r["words_kept"][name]) for r in rows) + " |")  # fmt: skip
    lines.append("| subject in other first-letter case / NFD found | "
                 + " | ".join(cell(r["subject_forms"]) for r in rows) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.languages", description=__doc__.splitlines()[0])
    p.add_argument("--languages", default="ja,uk,vi", help="comma-separated, of the dumps in ../shared/data/wiki-i18n")
    p.add_argument("--probe", type=int, default=200, help="stored sentences the self-probe asks back")
    p.add_argument("--vocab", type=int, default=6000, help="the tiny model's tokenizer vocabulary")
    p.add_argument("--work", type=Path, default=RUNS / "bench-languages")
    p.add_argument("--reuse", action="store_true", help="measure the datastores a previous run built (no build)")
    p.add_argument("--tokenizer", type=Path, action="append", default=None,
                   help="another tokenizer (a directory) whose share of each dump's words kept as targets is measured "
                        "beside the model's own (repeatable; default: bert-base-uncased's, the default model's)")  # fmt: skip
    args = p.parse_args()
    args.tokenizer = args.tokenizer or [SHARED / "data" / "tokenizer" / "bert-base-uncased"]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    languages = [x.strip() for x in args.languages.split(",") if x.strip()]
    missing = [x for x in languages if not dump_of(x).is_file()]
    if missing:
        p.error(f"no dump for {', '.join(missing)} in {DUMPS}")
    rows = [one_language(x, args) for x in languages]
    print(table(rows))
    path = write_result("languages", {"machine": machine(), "vocab": args.vocab, "probe": args.probe,
                                      "model": "tiny random XLM-R-style (hidden 32, 2 layers), tokenizer trained "
                                               "on each dump", "languages": rows, "table": table(rows)})  # fmt: skip
    print(f"wrote {path}")
    print(json.dumps({r["language"]: r["warnings"] for r in rows}, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
