"""AnswerPipeline: retrieval -> one forward pass (embedding + p_MLM) -> restricted kNN -> interpolation.

No HTTP and no Redis in here: the cache is injected behind the `Cache` protocol, and the web layer decides
how work is batched and which thread runs it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import numpy as np

from bertknn.core.encoder import MaskedInput, MaskedLMEncoder
from bertknn.core.errors import (
    CorruptCacheValue,
    DatastoreError,
    ModelLoadError,
    QueryError,
    RetrieverUnavailable,
)
from bertknn.core.format import Datastore, validate_datastore
from bertknn.core.topk import top_set
from bertknn.service.cache import Cache, InMemoryCache, cache_key
from bertknn.service.codec import PMlmAt, QueryEncoding, decode_hits, encode_hits
from bertknn.service.interpolate import (
    AdaptiveRule,
    Interpolation,
    adaptive_lambda,
    interpolate,
    interpolated_top_k,
    knn_skipped,
    knn_sparse,
    top_k,
    top_k_among,
)
from bertknn.service.retrieval.knn import EMPTY, ArticleSearch, Neighbours, RestrictedKnn

if TYPE_CHECKING:
    from bertknn.service.words import WordAnswerer

logger = logging.getLogger(__name__)

RetrieverName = Literal["bm25", "tfidf", "none"]
_MASK_RE = re.compile(r"\[\s*mask\s*\]", re.IGNORECASE)
_SPACES = re.compile(r"\s+")



@dataclass(frozen=True)
class Query:
    text: str
    subject: str | None = None
    top_k: int = 10
    retriever: RetrieverName = "bm25"
    num_articles: int = 3
    k: int = 128
    temperature: float = 6.0
    lambda_: float = 0.3
    return_contexts: bool = True
    contexts_per_answer: int = 3
    interpolation: Interpolation = "fixed"  # adaptive: lambda from `rule`, kNN skipped when the MLM is confident
    rule: AdaptiveRule | None = None  # the adaptive rule; None = AdaptiveRule() defaults


@dataclass(frozen=True)
class TokenProb:
    token: str
    prob: float


@dataclass(frozen=True)
class Context:
    article: str
    sentence: str  # the word is marked as **word**
    distance: float
    rank: int  # 1-based rank of this neighbour among the k


@dataclass(frozen=True)
class Prediction:
    token: str  # whole-word datastores: the word
    token_id: int  # -1 for a word of several wordpieces
    prob: float
    p_mlm: float
    p_knn: float
    contexts: list[Context]
    pieces: int = 1  # wordpieces of the answer (> 1 only from a whole-word datastore)


@dataclass(frozen=True)
class ArticleHit:
    title: str
    score: float | None
    rule: Literal["subject", "bm25", "tfidf", "none"]


@dataclass(frozen=True)
class Distributions:
    p_mlm: np.ndarray
    p_knn: np.ndarray
    p: np.ndarray


@dataclass(frozen=True)
class Answer:
    predictions: list[Prediction]
    mlm: list[TokenProb]
    knn: list[TokenProb]
    articles: list[ArticleHit]
    lambda_used: float
    timings_ms: dict[str, float]
    cache: dict[str, str]
    distributions: Distributions | None = None
    interpolation: Interpolation = "fixed"
    knn_skipped: bool = False  # adaptive: answered by the MLM alone, no retrieval and no kNN search ran


@dataclass
class Stage:
    """Wall time of the pipeline's stages, in milliseconds."""

    times: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds * 1000.0


@dataclass(frozen=True)
class PendingEncoding:
    """A query's forward-pass output before its p_MLM head is kept: `AnswerPipeline.complete` makes the
    `QueryEncoding`. (The service selects the head off the model's thread when the model has other work.)"""

    key: str  # the encoding's cache key
    embedding: np.ndarray  # float32 [hidden]
    log_probs: np.ndarray  # float32 [vocab], log p_MLM at the mask


def retrieval_text(text: str) -> str:
    """Query text for the sparse retrievers: the cloze question without [MASK], whitespace collapsed."""
    return _SPACES.sub(" ", _MASK_RE.sub(" ", text)).strip()


class AnswerPipeline:
    def __init__(
        self,
        encoder: MaskedLMEncoder,
        datastore: Datastore,
        *,
        cache: Cache | None = None,
        key_prefix: str = "bertknn",
        mlm_top_entries: int = 2048,
        retrievers: dict[str, object] | None = None,
        subjects: object | None = None,
        global_knn_factory: Callable[[], object] | None = None,
    ):
        check_compatible(encoder, datastore)
        self.encoder = encoder
        self.datastore = datastore
        self.cache: Cache = cache if cache is not None else InMemoryCache()
        self.key_prefix = key_prefix
        self.mlm_top_entries = mlm_top_entries
        self.knn = RestrictedKnn(datastore)
        self.retrievers = retrievers if retrievers is not None else open_retrievers(datastore)
        if subjects is None:
            from bertknn.service.retrieval.subject import SubjectResolver

            subjects = SubjectResolver(datastore)
        self.subjects = subjects
        self._global_knn_factory = global_knn_factory or (lambda: _open_global_knn(datastore))
        self._global_knn: object | None = None
        self._id_to_token = encoder.tokenizer.convert_ids_to_tokens(list(range(encoder.vocab_size)))
        self.words: WordAnswerer | None = None  # whole-word datastores: answers are words (service/words.py)
        if datastore.whole_words:
            from bertknn.service.words import WordAnswerer

            self.words = WordAnswerer(self)

    @classmethod
    def open(
        cls,
        datastore_dir: Path | str,
        *,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        cache: Cache | None = None,
        key_prefix: str = "bertknn",
        mlm_top_entries: int = 2048,
        verify_checksums: bool = False,
    ) -> AnswerPipeline:
        """Load and check everything once: datastore (validated), model (hash-checked), indexes, JVM."""
        problems = validate_datastore(datastore_dir, hashes=verify_checksums)
        if problems:
            raise DatastoreError(f"datastore failed validation: {problems[0]}")
        datastore = Datastore(datastore_dir)
        man = datastore.manifest
        name = model or man.model.name
        encoder = MaskedLMEncoder.load(name, layer=man.layer, device=device, dtype=dtype, max_seq_len=man.max_seq_len)
        return cls(encoder, datastore, cache=cache, key_prefix=key_prefix, mlm_top_entries=mlm_top_entries)

    def for_datastore(self, datastore_dir: Path | str, *, verify_checksums: bool = False) -> AnswerPipeline:
        """A pipeline over another datastore (a new version of this one) that shares this one's model and cache.

        The model is not loaded again; the datastore is validated and must have been built with the same model
        weights (`ModelLoadError` otherwise), its indexes are opened here. Used by the service's live reload.
        """
        problems = validate_datastore(datastore_dir, hashes=verify_checksums)
        if problems:
            raise DatastoreError(f"datastore failed validation: {problems[0]}")
        return type(self)(
            self.encoder,
            Datastore(datastore_dir),
            cache=self.cache,
            key_prefix=self.key_prefix,
            mlm_top_entries=self.mlm_top_entries,
        )

    # ---- identity -----------------------------------------------------------------------------------------

    def identity(self) -> dict[str, dict[str, object]]:
        man = self.datastore.manifest
        return {
            "model": {
                "name": self.encoder.name,
                "weights_sha256": self.encoder.weights_sha256,
                "layer": self.encoder.layer,
                "num_layers": self.encoder.num_layers,
            },
            "datastore": {
                "id": man.datastore_id,
                "version": man.version,
                "articles": man.counts.articles,
                "contexts": man.counts.contexts,
                "model_name": man.model.name,
            },
        }

    def token(self, token_id: int) -> str:
        return self._id_to_token[token_id]

    # ---- stage 0: validation ------------------------------------------------------------------------------

    def check_query(self, query: Query) -> MaskedInput:
        """Tokenise and check one query; `QueryError` says what to fix."""
        return self.encoder.query_input(query.text)

    # ---- stage 1: the forward pass (cached) ---------------------------------------------------------------

    def _enc_key(self, inp: MaskedInput) -> str:
        return cache_key(self.key_prefix, "enc", self.encoder.weights_sha256, self.encoder.layer, inp.input_ids)

    def _decode(self, raw: bytes | None) -> QueryEncoding | None:
        if raw is None:
            return None
        try:
            return QueryEncoding.from_bytes(raw, hidden=self.encoder.hidden_size, vocab_size=self.encoder.vocab_size)
        except CorruptCacheValue as exc:
            _count_corrupt(self.cache)
            logger.warning("corrupt cache value ignored (%s)", exc)
            return None

    def local_encoding(self, inp: MaskedInput) -> QueryEncoding | None:
        """The cached encoding of ``inp`` when the cache lives in this process (a dictionary look-up, safe on
        the event loop); None on a miss, or when the cache is remote (Redis: looked up with the batch instead)."""
        if not self.cache.in_process:
            return None
        enc = self._decode(self.cache.get_many([self._enc_key(inp)])[0])
        if enc is not None:
            _count_hits(self.cache, 1, 0)
        return enc

    def encode(
        self, inputs: Sequence[MaskedInput], *, defer_store: list[Callable[[], None]] | None = None
    ) -> tuple[list[QueryEncoding], list[bool]]:
        """Embeddings and p_MLM heads for a batch: cache first, one batched forward pass for the misses.

        ``defer_store``: with a remote cache (Redis), instead of writing the new encodings before returning,
        append the write to this list: the service runs it after the answers went out, so the network round
        trip is off the requests' path. (An in-process cache is written at once: it costs microseconds.)
        """
        out, hits = self.forward(inputs, defer_store=defer_store)
        return cast(list[QueryEncoding], out), hits

    def forward(
        self,
        inputs: Sequence[MaskedInput],
        *,
        defer_store: list[Callable[[], None]] | None = None,
        select_heads: bool = True,
    ) -> tuple[list[QueryEncoding | PendingEncoding], list[bool]]:
        """`encode`; with ``select_heads=False`` the misses come back as `PendingEncoding`s, whose p_MLM heads
        `complete` selects later, on another thread (the model's thread is then free for the next batch)."""
        keys = [self._enc_key(x) for x in inputs]
        out: list[QueryEncoding | PendingEncoding | None] = [self._decode(raw) for raw in self.cache.get_many(keys)]
        hits = [enc is not None for enc in out]
        todo = [i for i, enc in enumerate(out) if enc is None]
        if todo:
            result = self.encoder.encode([inputs[i] for i in todo], with_mlm=True)
            assert result.mlm_log_probs is not None
            rows = result.mlm_log_probs.numpy()
            pending = [PendingEncoding(keys[i], result.embeddings[j], rows[j]) for j, i in enumerate(todo)]
            # with select_heads, the heads are kept here, on the calling (model) thread
            fresh: Sequence[QueryEncoding | PendingEncoding] = (
                self._complete_all(pending, defer_store) if select_heads else pending
            )
            for i, enc in zip(todo, fresh, strict=True):
                out[i] = enc
        _count_hits(self.cache, sum(hits), len(hits) - sum(hits))
        return [e for e in out if e is not None], hits

    def complete(
        self, pending: PendingEncoding, *, defer_store: list[Callable[[], None]] | None = None
    ) -> QueryEncoding:
        """The `QueryEncoding` of a `forward(..., select_heads=False)` miss: the same one `encode` makes, and
        into the cache it goes (``defer_store`` as in `encode`)."""
        return self._complete_all([pending], defer_store)[0]

    def _complete_all(
        self, pending: Sequence[PendingEncoding], defer_store: list[Callable[[], None]] | None
    ) -> list[QueryEncoding]:
        """Keep each row's `mlm_top_entries` most probable entries (`top_set`); one cache write for all."""
        encs = []
        for p in pending:
            values, ids = top_set(p.log_probs, self.mlm_top_entries)
            encs.append(QueryEncoding.from_top(p.embedding, values, ids, self.encoder.vocab_size))
        self._store({p.key: enc for p, enc in zip(pending, encs, strict=True)}, defer_store)
        return encs

    def _store(self, fresh: dict[str, QueryEncoding], defer_store: list[Callable[[], None]] | None) -> None:
        cache = self.cache

        def store() -> None:
            cache.set_many({key: enc.to_bytes() for key, enc in fresh.items()})

        if defer_store is None or cache.in_process:
            store()
        else:
            defer_store.append(store)

    # ---- stage 2: article retrieval (cached) -------------------------------------------------------------

    def retrieve(self, query: Query) -> tuple[list[ArticleHit], str]:
        """The articles to search: the subject's own article when it has one, else the ranker's top N."""
        if query.retriever == "none":
            return [], "none"
        ranker = self.retrievers.get(query.retriever)
        if ranker is None:
            raise RetrieverUnavailable(
                f"retriever {query.retriever!r} has no index in this datastore; rebuild it with sparse indexes"
            )
        text = retrieval_text(query.text)
        # The datastore's id and version: a live update (new articles, new sparse indexes) never reuses hits of
        # the version before. The "enc" key needs neither: the forward pass depends on the model alone.
        key = cache_key(
            self.key_prefix, "ret", query.retriever, self.datastore.id, self.datastore.version, text.casefold(),
            query.subject, query.num_articles,
        )  # fmt: skip
        raw = self.cache.get_many([key])[0]
        if raw is not None:
            try:
                return [ArticleHit(t, s, r) for t, s, r in decode_hits(raw)], "hit"  # type: ignore[arg-type]
            except CorruptCacheValue as exc:
                _count_corrupt(self.cache)
                logger.warning("corrupt cache value ignored (%s)", exc)
        hits: list[ArticleHit] = []
        title = self.subjects.resolve(query.subject) if query.subject else None  # type: ignore[attr-defined]
        if title is not None:
            # The paper's rule for knowledge-base queries: the subject's own article alone. (Filling the other
            # N-1 slots from the ranker lowered macro P@1 from 33.2 to 23.8 on bench/quality.)
            hits.append(ArticleHit(title, None, "subject"))
        elif text:
            hits = [
                ArticleHit(t, float(score), query.retriever)
                for t, score in ranker.top_articles(text, query.num_articles)  # type: ignore[attr-defined]
            ]
        self.cache.set_many({key: encode_hits([(h.title, h.score, h.rule) for h in hits])})
        return hits, "miss"

    # ---- stage 3+4: kNN and interpolation -----------------------------------------------------------------

    def prepare_search(self, query: Query, articles: list[ArticleHit]) -> ArticleSearch | None:
        """The retrieved articles' rows, read and indexed for `neighbours` before the embedding exists (the
        service runs this next to the retrieval, during the forward pass); None when there is nothing to prepare."""
        if query.retriever == "none" or not articles:
            return None
        return self.knn.prepare([a.title for a in articles])

    def neighbours(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], search: ArticleSearch | None = None
    ) -> Neighbours:
        """The k nearest stored contexts among ``articles`` (``search``: their rows from `prepare_search`)."""
        vec = enc.embedding.astype(np.float32)
        if query.retriever == "none":
            return self._global_search(vec, query.k)
        if not articles:
            return EMPTY
        titles = [a.title for a in articles]
        if search is None or search.titles != tuple(titles):
            search = self.knn.prepare(titles)
        return search.search(vec, query.k)

    def _global_search(self, vec: np.ndarray, k: int) -> Neighbours:
        if self._global_knn is None:
            self._global_knn = self._global_knn_factory()
        dist, rows = self._global_knn.search(vec, k)  # type: ignore[attr-defined]
        keep = rows >= 0
        rows = rows[keep]
        if len(rows) == 0:
            return EMPTY
        # Re-rank the candidates with their exact float16 vectors: p_kNN sees true distances, not PQ estimates.
        vectors = np.stack([self._row_vector(int(r)) for r in rows]).astype(np.float32)
        exact = ((vectors - vec[None, :]) ** 2).sum(axis=1)
        order = np.argsort(exact, kind="stable")
        rows = rows[order]
        return Neighbours(exact[order].astype(np.float32), rows, self.datastore.labels_at(rows))

    def _row_vector(self, global_row: int) -> np.ndarray:
        pos, row = self.datastore.locate(global_row)
        return np.asarray(self.datastore.shards[pos].vectors[row])

    def skips_knn(self, query: Query, enc: QueryEncoding) -> bool:
        """Adaptive queries whose p_MLM is confident enough skip retrieval and kNN (decided from p_MLM alone)."""
        return query.interpolation == "adaptive" and knn_skipped(query.rule or _DEFAULT_RULE, enc.p_mlm())

    def lambda_for(
        self, query: Query, p_mlm: np.ndarray | None, p_knn: np.ndarray | None, nbrs: Neighbours
    ) -> float:
        """The kNN weight of this query: fixed, or the adaptive rule's; 0 when no neighbour was found.

        ``p_mlm``, ``p_knn``: the dense distributions, which only the adaptive rule reads (None is fine in fixed
        mode)."""
        if not len(nbrs):
            return 0.0
        if query.interpolation == "adaptive":
            if p_mlm is None or p_knn is None:
                raise ValueError("the adaptive rule needs the dense p_MLM and p_kNN")
            return adaptive_lambda(query.rule or _DEFAULT_RULE, p_mlm, p_knn)
        return query.lambda_

    def answer(
        self,
        query: Query,
        enc: QueryEncoding,
        articles: list[ArticleHit],
        nbrs: Neighbours,
        *,
        with_distributions: bool = False,
    ) -> tuple[list[Prediction], list[TokenProb], list[TokenProb], float, Distributions | None, list[ArticleHit]]:
        if self.words is not None:
            preds, mlm, knn, lam, dists = self.words.answer(query, enc, nbrs, with_distributions=with_distributions)
            return preds, mlm, knn, lam, dists, self._articles_seen(query, nbrs, articles)
        knn_ids, knn_probs = knn_sparse(nbrs.distances, nbrs.labels, query.temperature)

        def dense_knn() -> np.ndarray:
            p = np.zeros(self.encoder.vocab_size, dtype=np.float32)
            p[knn_ids] = knn_probs
            return p

        # The dense p_MLM and p_kNN (vocabulary-sized arrays) only where a whole distribution is read: the
        # adaptive rule, the returned distributions, the dense ranking below. Otherwise both are read at a few ids.
        dense = enc.p_mlm() if with_distributions or query.interpolation == "adaptive" else None
        p_knn = dense_knn() if dense is not None else None
        lam = self.lambda_for(query, dense, p_knn, nbrs)
        p_mlm: np.ndarray | PMlmAt = dense if dense is not None else enc.p_mlm_at()
        # Rank the stored p_MLM entries and the neighbours' words only: every other id shares one p_MLM value
        # and has no kNN mass. The dense path runs when that value could reach the top k, or for evaluation.
        fast = None
        if not with_distributions:
            fast = interpolated_top_k(p_mlm, enc.top_ids, knn_ids, knn_probs, lam, query.top_k, mlm_rest=enc.rest_p_mlm())
        if fast is None:
            p_mlm = enc.p_mlm()
            p_knn = dense_knn() if p_knn is None else p_knn
            p = interpolate(p_knn, p_mlm, lam)
            best, mlm_top = top_k(p, query.top_k), top_k(p_mlm, query.top_k)
        else:
            (best, mlm_top), p = fast, None
        preds = []
        ranks = _ranks_by_label(nbrs.labels, {t for t, _ in best}, query.contexts_per_answer) if query.return_contexts else {}
        best_p_mlm = p_mlm[np.array([t for t, _ in best], dtype=np.int64)].tolist()
        shown = iter(self.contexts(nbrs, [r for t, _ in best for r in ranks.get(t, [])]))  # one read for all
        knn_at = dict(zip(knn_ids.tolist(), knn_probs.tolist(), strict=True))  # float32 values, as in p_kNN
        for (token_id, prob), pm in zip(best, best_p_mlm, strict=True):
            contexts = [next(shown) for _ in ranks.get(token_id, [])]
            preds.append(Prediction(self.token(token_id), token_id, prob, pm, knn_at.get(token_id, 0.0), contexts))
        mlm = [TokenProb(self.token(i), pr) for i, pr in mlm_top]
        knn = [TokenProb(self.token(i), pr) for i, pr in top_k_among(knn_ids, knn_probs, query.top_k, None) or []]
        dists = Distributions(enc.p_mlm(), p_knn, p) if with_distributions and p is not None and p_knn is not None else None
        return preds, mlm, knn, lam, dists, self._articles_seen(query, nbrs, articles)

    def _articles_seen(self, query: Query, nbrs: Neighbours, articles: list[ArticleHit]) -> list[ArticleHit]:
        """Without retrieval, the articles the neighbours came from (by count); else the retrieved ones."""
        if query.retriever != "none" or not len(nbrs):
            return articles
        counts: dict[str, int] = {}
        for ref in self.datastore.contexts(nbrs.rows[: query.k].tolist()):
            counts[ref.article] = counts.get(ref.article, 0) + 1
        return [ArticleHit(t, float(c), "none") for t, c in sorted(counts.items(), key=lambda x: -x[1])]

    def contexts(self, nbrs: Neighbours, ranks: list[int]) -> list[Context]:
        """The stored sentences of the neighbours at these ranks (0-based), the word in ``**bold**``."""
        out = []
        refs = self.datastore.contexts([int(nbrs.rows[r]) for r in ranks])
        for rank, ref in zip(ranks, refs, strict=True):
            a, b = ref.span
            marked = f"{ref.sentence[:a]}**{ref.sentence[a:b]}**{ref.sentence[b:]}"
            out.append(Context(ref.article, marked, float(nbrs.distances[rank]), int(rank) + 1))
        return out

    # ---- the whole thing, synchronously (evaluation, CLI) --------------------------------------------------

    def predict_batch(self, queries: Sequence[Query], *, with_distributions: bool = False) -> list[Answer]:
        """Answer several queries with one batched forward pass. Raises `QueryError` naming the bad query."""
        t0 = time.perf_counter()
        inputs = []
        for i, q in enumerate(queries):
            try:
                inputs.append(self.check_query(q))
            except QueryError as exc:
                if len(queries) == 1:
                    raise
                raise QueryError(f"query {i}: {exc}") from None
        t1 = time.perf_counter()
        encs, hits = self.encode(inputs)
        embed_s = time.perf_counter() - t1
        answers = []
        for q, enc, hit in zip(queries, encs, hits, strict=True):
            stage = Stage()
            stage.add("embedding", embed_s / max(1, len(queries)))
            answers.append(self.finish(q, enc, "hit" if hit else "miss", stage, with_distributions=with_distributions))
        logger.debug("batch of %d answered in %.1f ms", len(queries), (time.perf_counter() - t0) * 1000)
        return answers

    def predict(self, query: Query, *, with_distributions: bool = False) -> Answer:
        return self.predict_batch([query], with_distributions=with_distributions)[0]

    def finish(
        self,
        query: Query,
        enc: QueryEncoding,
        enc_cache: str,
        stage: Stage,
        *,
        articles: tuple[list[ArticleHit], str] | None = None,
        search: ArticleSearch | None = None,
        with_distributions: bool = False,
    ) -> Answer:
        """Everything after the forward pass (retrieval too, unless the caller already ran it; ``search``: the
        articles' rows, when the caller prepared them with `prepare_search`).

        An adaptive query whose p_MLM is confident skips retrieval and kNN entirely (``articles`` is then
        ignored); its timings have no retrieval and no knn entry.
        """
        skipped = self.skips_knn(query, enc)  # before any retrieval or kNN work
        hits: list[ArticleHit]
        if skipped:
            hits, ret_cache, nbrs = [], "none", EMPTY
        else:
            t = time.perf_counter()
            if articles is None:
                articles = self.retrieve(query)
                stage.add("retrieval", time.perf_counter() - t)
            hits, ret_cache = articles
            t = time.perf_counter()
            nbrs = self.neighbours(query, enc, hits, search)
            stage.add("knn", time.perf_counter() - t)
        t = time.perf_counter()
        preds, mlm, knn, lam, dists, hits = self.answer(query, enc, hits, nbrs, with_distributions=with_distributions)
        stage.add("interpolation", time.perf_counter() - t)
        for name in ("embedding", "interpolation") if skipped else ("retrieval", "embedding", "knn", "interpolation"):
            stage.times.setdefault(name, 0.0)
        stage.times["total"] = sum(v for k, v in stage.times.items() if k != "total")
        return Answer(
            preds,
            mlm,
            knn,
            hits,
            lam,
            {k: round(v, 3) for k, v in stage.times.items()},
            {"encoding": enc_cache, "retrieval": ret_cache},
            dists,
            query.interpolation,
            skipped,
        )

    def release(self) -> None:
        """Close what belongs to this datastore version (its retrievers), not the shared model or cache."""
        for r in self.retrievers.values():
            close = getattr(r, "close", None)
            if close:
                close()

    def close(self) -> None:
        self.release()
        self.cache.close()


_DEFAULT_RULE = AdaptiveRule()


def check_compatible(encoder: MaskedLMEncoder, datastore: Datastore) -> None:
    """Refuse a model that is not the one the datastore was built with, or a layer it does not have."""
    man = datastore.manifest
    if man.model.weights_sha256 != encoder.weights_sha256:
        raise ModelLoadError(
            f"model {encoder.name!r} (weights sha256 {encoder.weights_sha256[:12]}...) is not the model this datastore "
            f"was built with: {man.model.name!r} ({man.model.weights_sha256[:12]}...). Serve it with that model, or "
            "rebuild the datastore with this one."
        )
    if man.model.name != encoder.name:
        logger.warning(
            "model loaded as %r, manifest names %r: same weights (sha256 match), accepted", encoder.name, man.model.name
        )
    if not 0 <= man.layer <= encoder.num_layers:
        raise ModelLoadError(f"datastore layer {man.layer} is out of range for a {encoder.num_layers}-layer model")
    if encoder.layer != man.layer:
        raise ModelLoadError(f"encoder layer {encoder.layer} != datastore layer {man.layer}")
    if man.model.hidden_size != encoder.hidden_size or man.model.vocab_size != encoder.vocab_size:
        raise ModelLoadError("model hidden size or vocabulary differs from the datastore's")


def reduce_jvm_signals() -> None:
    """Start the JVM with -Xrs so that it leaves SIGTERM/SIGINT to Python (graceful shutdown needs them)."""
    try:
        import jnius_config
    except ImportError:
        return
    if not jnius_config.vm_running and "-Xrs" not in jnius_config.get_options():
        jnius_config.add_options("-Xrs")


def configure_jvm(options: Sequence[str]) -> bool:
    """Add options for the JVM that Lucene runs in; False (nothing done) when it is already running.

    Must run before the first retriever opens: the JVM starts once per process and keeps its options.
    """
    try:
        import jnius_config
    except ImportError:
        return False
    if jnius_config.vm_running:
        return False
    have = set(jnius_config.get_options())
    jnius_config.add_options(*[o for o in options if o not in have])
    return True


def open_retrievers(datastore: Datastore) -> dict[str, object]:
    """The sparse retrievers whose indexes this datastore has (the JVM starts here, once per process)."""
    out: dict[str, object] = {}
    idx = datastore.manifest.indexes
    if "bm25" in idx:
        reduce_jvm_signals()
        from bertknn.service.retrieval.sparse import Bm25Retriever

        out["bm25"] = Bm25Retriever(datastore.root / idx["bm25"])
    if "tfidf" in idx:
        from bertknn.service.retrieval.sparse import TfidfRetriever

        out["tfidf"] = TfidfRetriever(datastore.root / idx["tfidf"])
    return out


def _open_global_knn(datastore: Datastore) -> object:
    if "ivfpq" not in datastore.manifest.indexes:
        raise RetrieverUnavailable(
            "retriever 'none' needs the whole-datastore IVF-PQ index; build it with "
            f"`python -m datastore_builder ivfpq {datastore.root}`"
        )
    from bertknn.service.retrieval.global_knn import IvfPqKnn

    return IvfPqKnn(datastore)


def _ranks_by_label(labels: np.ndarray, wanted: set[int], limit: int) -> dict[int, list[int]]:
    """For each wanted label, the ranks (0-based, nearest first) of its first ``limit`` neighbours: one pass over
    the neighbours for all answers (instead of one comparison of every neighbour per answer)."""
    out: dict[int, list[int]] = {}
    for rank, label in enumerate(labels.tolist()):
        if label in wanted:
            ranks = out.setdefault(label, [])
            if len(ranks) < limit:
                ranks.append(rank)
    return out


def _count_hits(cache: Cache, hits: int, misses: int) -> None:
    stats = getattr(cache, "stats", None)
    if stats is not None:
        stats.hits += hits
        stats.misses += misses


def _count_corrupt(cache: Cache) -> None:
    stats = getattr(cache, "stats", None)
    if stats is not None:
        stats.corrupt += 1
