"""Preparing a shard's contexts from its articles, in worker processes or here: sentences split, targets chosen
and masked, the rows' labels, spans and sentences kept (what `bertknn.builder.embed` embeds)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from bertknn.builder.corpus import Article, Link
from bertknn.builder.sentences import SentenceSplitter
from bertknn.builder.stages import StageTimes
from bertknn.builder.targets import TargetMode, TargetSelector, masked_ids
from bertknn.builder.wikitext import drop_reason
from bertknn.builder.writer import DROPPED
from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.inputs import MaskedInput, PackedInputs
from bertknn.core.languages import LanguageRules
from bertknn.core.vocab_cache import VocabCache
from bertknn.core.words import WordEntry, WordTable, WordTableBuilder


@dataclass
class PreparedShard:
    """Everything but the embeddings: made by worker processes while the model runs on the previous shard."""

    index: int
    articles: list[dict]
    sentences: list[str]
    inputs: PackedInputs  # (arrays: a worker's result pickles as a few buffers, not an object per context)
    labels: np.ndarray
    sentence_ids: np.ndarray
    spans: np.ndarray
    words: WordTable | None = None  # whole-word targets: the shard's word table (labels index it)
    times: StageTimes = field(default_factory=StageTimes)  # the worker's markup, split and targets
    entity_labels: np.ndarray | None = None  # datastores with links: int32 [rows], index into entities, or -1
    entities: list[str] | None = None  # the link targets the shard's rows name (normalised titles)

    @property
    def rows(self) -> int:
        return len(self.inputs)

    def select(self, a: int, b: int) -> PreparedShard:
        """Articles ``[a, b)`` alone, rows and sentences renumbered from 0 (the word table is kept whole)."""
        if a == 0 and b == len(self.articles):
            return self
        if a == b:
            return _empty_prepared(self.index, self.words is not None)
        r0, r1 = self.articles[a]["row_start"], self.articles[b - 1]["row_end"]
        s0, s1 = self.articles[a]["sent_start"], self.articles[b - 1]["sent_end"]
        metas = [
            {**m, "row_start": m["row_start"] - r0, "row_end": m["row_end"] - r0,
             "sent_start": m["sent_start"] - s0, "sent_end": m["sent_end"] - s0}
            for m in self.articles[a:b]
        ]  # fmt: skip
        return PreparedShard(
            self.index, metas, self.sentences[s0:s1], self.inputs[r0:r1], self.labels[r0:r1],
            self.sentence_ids[r0:r1] - s0, self.spans[r0:r1], self.words,
            entity_labels=None if self.entity_labels is None else self.entity_labels[r0:r1], entities=self.entities,
        )  # fmt: skip

    @staticmethod
    def concat(index: int, pieces: list[PreparedShard], whole_words: bool) -> PreparedShard:
        """One shard's worth of prepared pieces, in order: offsets shifted, word tables merged by word text,
        entity tables by title."""
        linked = any(p.entity_labels is not None for p in pieces)
        if len(pieces) == 1 and not whole_words and not linked:
            pieces[0].index = index
            return pieces[0]
        out = _empty_prepared(index, whole_words)
        labels, sent_ids, spans = [out.labels], [out.sentence_ids], [out.spans]
        inputs = [out.inputs]
        words = _WordTableMerger() if whole_words else None
        entity_ids: dict[str, int] = {}
        entity_labels: list[np.ndarray] = []
        for piece in pieces:
            if not linked:
                break
            if piece.entity_labels is None or piece.entities is None:
                assert piece.rows == 0, "a piece without links among pieces with links"
                continue
            used = np.unique(piece.entity_labels[piece.entity_labels >= 0])
            mapping = np.full(len(piece.entities) + 1, -1, dtype=np.int32)  # (the last slot maps -1 to -1)
            for old in used.tolist():
                mapping[old] = entity_ids.setdefault(piece.entities[old], len(entity_ids))
            entity_labels.append(mapping[piece.entity_labels])
        if linked:
            out.entity_labels = np.concatenate([np.zeros(0, np.int32), *entity_labels]).astype(np.int32)
            out.entities = list(entity_ids)
        for piece in pieces:
            rows, sents = sum(len(x) for x in inputs), len(out.sentences)
            out.articles.extend(
                {**m, "row_start": m["row_start"] + rows, "row_end": m["row_end"] + rows,
                 "sent_start": m["sent_start"] + sents, "sent_end": m["sent_end"] + sents}
                for m in piece.articles
            )  # fmt: skip
            out.sentences.extend(piece.sentences)
            inputs.append(piece.inputs)
            labels.append(piece.labels if words is None or piece.words is None else words.remap(piece.words, piece.labels))
            sent_ids.append(piece.sentence_ids + sents)
            spans.append(piece.spans)
        out.inputs = PackedInputs.concat(inputs)
        out.labels = np.concatenate(labels).astype(np.int32, copy=False)
        out.sentence_ids = np.concatenate(sent_ids).astype(np.int32, copy=False)
        out.spans = np.concatenate(spans).astype(np.int32, copy=False).reshape(-1, 2)
        if words is not None:
            out.words = words.table()
        return out


def _empty_prepared(index: int, whole_words: bool) -> PreparedShard:
    return PreparedShard(
        index, [], [], PackedInputs.of([]), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, 2), np.int32),
        WordTable([]) if whole_words else None,
    )  # fmt: skip


class _WordTableMerger:
    """Word ids of several pieces' tables -> ids of one shard table, in first-occurrence order (by word text,
    as ``WordTableBuilder`` assigns them within a piece)."""

    def __init__(self) -> None:
        self._by_text: dict[str, int] = {}
        self.entries: list[WordEntry] = []

    def remap(self, table: WordTable, labels: np.ndarray) -> np.ndarray:
        used, first = np.unique(labels, return_index=True)
        mapping = np.zeros(max(len(table), 1), dtype=np.int32)
        for old in used[np.argsort(first)].tolist():  # first occurrence order
            entry = table[old]
            new = self._by_text.get(entry.text)
            if new is None:
                new = self._by_text[entry.text] = len(self.entries)
                self.entries.append(entry)
            mapping[old] = new
        return mapping[labels] if len(labels) else labels

    def table(self) -> WordTable:
        return WordTable(self.entries)


class ShardPreparer:
    """Sentence splitting, target selection and masking for one shard's articles (no model needed)."""

    def __init__(
        self,
        tokenizer_path: str,
        max_seq_len: int,
        stopwords: frozenset[str],
        min_sentence_chars: int,
        targets: TargetMode = "single-piece",
        links: bool = False,
        vocab_cache: str = "auto",
    ):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, use_fast=True)
        self.links = links
        self.tokenizer = tokenizer
        self.inputs = ContextTokenizer(tokenizer, max_seq_len)
        kept = VocabCache.from_setting(vocab_cache)  # workers starting together: one makes it, the others read it
        if kept is not None:
            self.inputs.words.vocab = kept.words(self.inputs.words)
        self.selector = TargetSelector(tokenizer, stopwords, targets, words=self.inputs.words)
        self._splitters: dict[str, SentenceSplitter] = {}
        self.min_sentence_chars = min_sentence_chars

    def prepare(self, index: int, articles: list[Article]) -> PreparedShard:
        rows = _Rows()
        words = WordTableBuilder(self.inputs.words) if self.selector.mode == "whole-word" else None
        entity_ids: dict[str, int] = {}
        metas: list[dict] = []
        times = StageTimes()
        for art in articles:
            t0 = time.perf_counter()
            text, links = art.text_links() if self.links else (art.text, [])  # wikitext -> text: in the worker
            t1 = time.perf_counter()
            dropped: dict[str, int] = {}
            sents, sent_links = self._sentences(self.splitter(art.site.rules), text, links, entity_ids, dropped)
            t2 = time.perf_counter()
            times.add("markup", t1 - t0, 1 if art.markup == "wikitext" else 0)
            times.add("split", t2 - t1, len(sents))
            row_start, sent_start = len(rows.labels), len(rows.sentences)
            self._targets(sents, sent_links if self.links else None, rows, words, times)
            times.add("targets", time.perf_counter() - t2, len(rows.labels) - row_start)
            metas.append({"title": art.title, "id": art.id, "source": Path(art.source).name, "row_start": row_start,
                          "row_end": len(rows.labels), "sent_start": sent_start, "sent_end": len(rows.sentences),
                          **({DROPPED: dropped} if dropped else {})})  # fmt: skip
            for reason, n in dropped.items():
                times.drop(reason, n)
        return PreparedShard(
            index, metas, rows.sentences, PackedInputs.of(rows.inputs), np.asarray(rows.labels, dtype=np.int32),
            np.asarray(rows.sent_ids, dtype=np.int32), np.asarray(rows.spans, dtype=np.int32).reshape(-1, 2),
            None if words is None else words.table(), times,
            np.asarray(rows.entity_labels, dtype=np.int32) if self.links else None,
            list(entity_ids) if self.links else None,
        )  # fmt: skip

    def splitter(self, rules: LanguageRules) -> SentenceSplitter:
        """The sentence splitter of an article's language (made once per language)."""
        if rules.code not in self._splitters:
            self._splitters[rules.code] = SentenceSplitter(rules)
        return self._splitters[rules.code]

    def _sentences(
        self, splitter: SentenceSplitter, text: str, links: list[Link], entity_ids: dict[str, int],
        dropped: dict[str, int],
    ) -> tuple[list[str], list[list[tuple[int, int, int]]]]:  # fmt: skip
        """The article's kept sentences (long enough, no markup left: `sentence_problem`), each with the links
        inside it as (start, end, entity id) relative to the sentence; the others counted in ``dropped``."""
        sents: list[str] = []
        sent_links: list[list[tuple[int, int, int]]] = []
        cursor = 0
        for sent in splitter.split(text):
            at = text.find(sent, cursor)
            cursor = at + len(sent) if at >= 0 else cursor
            problem = drop_reason(sent, self.min_sentence_chars)
            if problem is not None:
                dropped[problem] = dropped.get(problem, 0) + 1
                continue
            sents.append(sent)
            inside = [] if at < 0 else [
                (ln.start - at, ln.end - at, entity_ids.setdefault(ln.target, len(entity_ids)))
                for ln in links if at <= ln.start and ln.end <= at + len(sent)
            ]  # fmt: skip
            sent_links.append(inside)
        return sents, sent_links

    def _targets(
        self, sents: list[str], sent_links: list[list[tuple[int, int, int]]] | None, rows: _Rows,
        words: WordTableBuilder | None, times: StageTimes,
    ) -> None:  # fmt: skip
        """Every target of the sentences as one row: its masked input, label, sentence, span and entity; the
        words that could be targets and those that are, counted in ``times`` (`StageTimes.count_words`)."""
        for tok_sent in self.selector.select(sents, sent_links):
            times.count_words(tok_sent.words, tok_sent.word_targets)
            sid = len(rows.sentences)
            rows.sentences.append(tok_sent.text)
            for target in tok_sent.targets:
                ids, pos = masked_ids(tok_sent, target, self.inputs.mask_id)
                rows.inputs.append(self.inputs.masked_input(ids, pos))
                if target.token_id < 0:
                    rows.labels.append(-1)  # an anchor that is no word target: an entity's row only
                else:
                    rows.labels.append(target.token_id if words is None else words.add(target.pieces))
                rows.entity_labels.append(target.entity)
                rows.sent_ids.append(sid)
                rows.spans.append((target.char_start, target.char_end))


@dataclass
class _Rows:
    """What one shard's preparation accumulates, row by row (sentences by sentence)."""

    sentences: list[str] = field(default_factory=list)
    inputs: list[MaskedInput] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    sent_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    entity_labels: list[int] = field(default_factory=list)


_WORKER: ShardPreparer | None = None


def init_worker(*args: object) -> None:
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it keeps the work)
    torch.set_num_threads(1)
    _WORKER = ShardPreparer(*args)  # type: ignore[arg-type]


def prepare_in_worker(index: int, articles: list[Article]) -> PreparedShard:
    assert _WORKER is not None
    return _WORKER.prepare(index, articles)
