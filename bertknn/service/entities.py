"""Entity answers over a datastore with links (docs/entities.md): p_kNN over entities, p_MLM of their names.

Neighbours: the restricted kNN over the retrieved articles' rows that carry a link (``answer: entity``), so every
neighbour names an entity (its link target, resolved through the redirects).

p_kNN(e) = the sum of softmax(-d/l) over the neighbours linked to e, whatever the anchor's words or number of
wordpieces: the same arithmetic as for words, with entities as labels.

p_MLM(e): the entity's surface form is its title without a trailing parenthetical ("Paris (mythology)" ->
"Paris"), lower-cased for an uncased model. A surface of one wordpiece takes p_MLM at the query's [MASK]; one of m
wordpieces (at most `MAX_NAME_PIECES`) is scored by the whole-word machinery in its one-pass form
(`bertknn.service.words`: the query with m masks, each piece read at its own mask, the product of the pieces'
probabilities; all lengths in one batched forward pass), for the `FILL_CANDIDATES` entities the neighbours weigh
most (the others' p_MLM is 0): an entity answer costs one extra forward pass, bounded by the answers, not by the
entities linked around the neighbours (docs/decisions/entity-fill.md). Candidates are the
neighbours' entities only: the MLM has no list of entities.

p(e) = lambda p_kNN(e) + (1 - lambda) p_MLM(e), ranked over the candidates. Word answers (the default) also say
which entity a word stands for: `entity_of_words`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import numpy as np

from bertknn.core.format import Datastore
from bertknn.core.format.table import EntityRef
from bertknn.core.titles import fold_title, normalize_title
from bertknn.service.answer import ContextReader, knn_offsets, lambda_for
from bertknn.service.codec import QueryEncoding
from bertknn.service.interpolate import interpolate, knn_distribution, top_k
from bertknn.service.results import ArticleHit, Assembled, Prediction, Query, TokenProb
from bertknn.service.retrieval.knn import Neighbours
from bertknn.service.words import WordAnswerer

# entities whose several-piece names are scored (at least the top_k asked for)
FILL_CANDIDATES = 16
# longer names score p_MLM 0 (their neighbours alone rank them): the fill pass has one row per length from 2 to
# this, each as long as the question plus its extra masks (docs/decisions/entity-fill.md)
MAX_NAME_PIECES = 4
PIECES_CACHED = 200_000  # names whose wordpieces are kept
_PARENTHETICAL = re.compile(r"\s*\([^()]*\)\s*$")


def surface_form(title: str, lower: bool) -> str:
    """What an entity is called in running text: its title without a trailing "(...)"."""
    text = _PARENTHETICAL.sub("", title).strip() or title
    return text.lower() if lower else text


class EntityAnswerer:
    """``answer: entity``: the neighbours' entities, scored as the module docstring says."""

    def __init__(self, datastore: Datastore, words: WordAnswerer, reader: ContextReader):
        self.datastore = datastore
        self.words = words  # the whole-word machinery (sequential fill), shared
        self.reader = reader
        self.lower = words.encoder.words.lowercase  # the model is uncased: names are lower-cased
        self._pieces: dict[str, tuple[int, ...]] = {}  # a name's pieces, tokenised once (bounded: PIECES_CACHED)

    def pieces(self, title: str) -> tuple[int, ...]:
        found = self._pieces.get(title)
        if found is None:
            if len(self._pieces) >= PIECES_CACHED:
                self._pieces.clear()
            found = self._pieces[title] = self.words.encoder.words.pieces_of(surface_form(title, self.lower))
        return found

    def candidates(self, nbrs: Neighbours) -> tuple[list[EntityRef], np.ndarray]:
        """The neighbours' entities (nearest first, each once by title) and each neighbour's candidate index."""
        found: list[EntityRef] = []
        index: dict[str, int] = {}
        labels = np.empty(len(nbrs), dtype=np.int64)
        wheres = self.datastore.links.entity_indexes(nbrs.rows.tolist())
        assert None not in wheres, "entity answers search linked rows only"
        refs = _refs(self.datastore, wheres)
        for n, where in enumerate(wheres):
            ref = refs[where]  # type: ignore[index]
            c = index.get(ref.title)
            if c is None:
                c = index[ref.title] = len(found)
                found.append(ref)
            labels[n] = c
        return found, labels

    def mlm_probs(
        self, query: Query, enc: QueryEncoding, entities: Sequence[EntityRef], p_knn: np.ndarray | None = None
    ) -> np.ndarray:
        """p_MLM of each entity's name. A one-piece name reads the query's own forward pass; a name of several
        pieces costs a fill pass, so only the `FILL_CANDIDATES` (at least top_k) entities the
        neighbours weigh most are filled (``p_knn``): the cost is bounded by the answers asked for, not by the
        number of entities linked around the neighbours. The others' p_MLM is 0."""
        token_p = enc.p_mlm()
        out = np.zeros(len(entities), dtype=np.float64)
        multi: list[int] = []
        fill = set(range(len(entities))) if query.fill_names else set()
        if query.fill_names and p_knn is not None and len(entities) > max(FILL_CANDIDATES, query.top_k):
            fill = set(np.argsort(-p_knn, kind="stable")[: max(FILL_CANDIDATES, query.top_k)].tolist())
        for i, e in enumerate(entities):
            pieces = self.pieces(e.title)
            if len(pieces) == 1:
                out[i] = float(token_p[pieces[0]])
            elif i in fill:
                multi.append(i)
        if multi:
            (out[multi],) = self.fill_names([(query.text, [entities[i].title for i in multi])], query.deadline)
        return out

    def fill_names(self, requests: Sequence[tuple[str, Sequence[str]]], deadline: float | None = None) -> list[list[float]]:
        """p_MLM of entity names at the [MASK] of several questions, (question, titles) each, from one fill pass
        for all of them (`WordFill.one_pass_probs`); a name of one piece or of more than `MAX_NAME_PIECES`
        scores 0 here (one piece: the question's own forward pass has it)."""
        asked: list[tuple[str, list[tuple[int, ...]]]] = []
        where: list[list[int]] = []
        for text, titles in requests:
            pieces = [self.pieces(t) for t in titles]
            keep = [i for i, p in enumerate(pieces) if 1 < len(p) <= MAX_NAME_PIECES]
            asked.append((text, [pieces[i] for i in keep]))
            where.append(keep)
        filled = self.words.fill.one_pass_probs(asked, deadline=deadline)
        out = []
        for (_, titles), keep, probs in zip(requests, where, filled, strict=True):
            row = [0.0] * len(titles)
            for i, p in zip(keep, probs.tolist(), strict=True):
                row[i] = p
            out.append(row)
        return out

    def answer(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], nbrs: Neighbours, *, with_distributions: bool
    ) -> Assembled:
        assert query.temperature is not None, "the pipeline resolves temperature auto"
        entities, labels = self.candidates(nbrs)
        offsets = knn_offsets(query, nbrs.article, articles)
        p_knn = knn_distribution(nbrs.distances, labels, len(entities), query.temperature, offsets)
        p_mlm = self.mlm_probs(query, enc, entities, p_knn).astype(np.float32)
        lam = lambda_for(query, p_mlm, p_knn, nbrs)
        p = interpolate(p_knn, p_mlm, lam)
        preds = []
        best, shown = self.reader.top_with_support(p, query, nbrs, labels)
        for c, prob in best:
            e = entities[c]
            preds.append(
                Prediction(
                    e.title, -1, prob, float(p_mlm[c]), float(p_knn[c]), shown[c], max(1, len(self.pieces(e.title))), e,
                )
            )  # fmt: skip
        mlm = [TokenProb(entities[c].title, pr) for c, pr in top_k(p_mlm, query.top_k)]
        knn = [TokenProb(entities[c].title, pr) for c, pr in top_k(p_knn, query.top_k, nonzero=True)]
        return Assembled(preds, mlm, knn, lam, None, self.reader.articles_seen(query, nbrs, articles))


def entity_of_words(
    datastore: Datastore, nbrs: Neighbours, words: Sequence[str], word_at: Sequence[str], temperature: float
) -> list[EntityRef | None]:
    """For each answer word, the entity it stands for: among the neighbours stored with that word, the entity their
    links name with the most kNN weight (softmax(-d/l), as p_kNN); else the entity titled like the word; else None.

    ``word_at``: the word stored at each neighbour rank (what the answerer compared with the answers)."""
    if not datastore.links.has_entities:  # no links, or links that name no entity: nothing to find
        return [None] * len(words)
    votes: dict[str, dict[str, tuple[float, EntityRef]]] = {}
    wanted = set(words)
    ranks = [r for r, word in enumerate(word_at) if word in wanted]
    found = datastore.links.entity_indexes(nbrs.rows[ranks].tolist())
    refs = _refs(datastore, found)
    distances = nbrs.distances.tolist()
    d0 = distances[0] if distances else 0.0
    for rank, where in zip(ranks, found, strict=True):
        if where is None:
            continue
        ref = refs[where]
        word = word_at[rank]
        weight = math.exp(-(distances[rank] - d0) / temperature)
        held = votes.setdefault(word, {}).get(ref.title)
        votes[word][ref.title] = ((held[0] if held else 0.0) + weight, ref)
    unvoted = [w for w in words if w not in votes]
    titled = dict(zip(unvoted, _titled(datastore, unvoted), strict=True))
    return [max(votes[w].values(), key=lambda v: (v[0], v[1].popularity))[1] if w in votes else titled[w] for w in words]


def _refs(datastore: Datastore, wheres: Sequence[tuple[int, int] | None]) -> dict[tuple[int, int], EntityRef]:
    """The entity of each distinct link among ``wheres`` (None: no link), looked up together."""
    distinct = list(dict.fromkeys(w for w in wheres if w is not None))
    return dict(zip(distinct, datastore.links.entities_of(distinct), strict=True))


# the answer words an entity lookup folds are the same few thousand again and again
_folded = functools.lru_cache(maxsize=65536)(fold_title)
_normalized = functools.lru_cache(maxsize=65536)(normalize_title)


def _titled(datastore: Datastore, words: Sequence[str]) -> list[EntityRef | None]:
    """The entity titled like each word (exactly, else ignoring case and accents: the first such article's), or
    None: four table queries for all the words."""
    out = datastore.links.entities_named([_normalized(w) for w in words])
    folded = {i: _folded(words[i]) for i, ref in enumerate(out) if ref is None}
    if folded:
        first = datastore.articles.first_folded(list(folded.values()))
        found = [(i, first[key]) for i, key in folded.items() if key in first]
        for (i, _), ref in zip(found, datastore.links.entities_named([title for _, title in found]), strict=True):
            out[i] = ref
    return out
