"""AnswerPipeline: retrieval -> one forward pass (embedding + p_MLM) -> restricted kNN -> interpolation.

No HTTP and no Redis in here: the cache is injected behind the `Cache` protocol, and the web layer decides
how work is batched and which thread runs it. Each stage lives in its own module; this one wires them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import DatastoreError, ModelLoadError, QueryError
from bertknn.core.format import Datastore, validate_datastore
from bertknn.core.inputs import MaskedInput
from bertknn.core.model_files import MlmHeadPolicy
from bertknn.core.model_ref import locate_model, public_model_name
from bertknn.core.query_model import QueryModel
from bertknn.core.vocab_cache import VocabCache
from bertknn.service.answer import Answerer, ContextReader, TokenAnswerer
from bertknn.service.assemble import AnswerAssembler
from bertknn.service.cache import Cache, InMemoryCache
from bertknn.service.encoding import QueryEncoder
from bertknn.service.entities import EntityAnswerer
from bertknn.service.results import Answer, Query, Stage
from bertknn.service.retrieval.articles import ArticleFinder, open_retrievers
from bertknn.service.retrieval.neighbours import GlobalKnn, NeighbourFinder
from bertknn.service.retrieval.sparse import Retriever
from bertknn.service.retrieval.subject import SubjectResolver
from bertknn.service.words import WordAnswerer

logger = logging.getLogger(__name__)

NO_LINKS = (
    "this datastore has no entity links (its corpus had none): build one from a corpus with links, a Wikipedia "
    "dump or JSON lines with a \"links\" list (docs/entities.md)"
)


def vocabulary(encoder: QueryModel) -> list[str]:
    """Every token id's shown text, in id order (a word as it reads: ``Paris``, not ``ĠParis``)."""
    return encoder.words.vocab.texts


def default_answerer(
    encoder: QueryModel, datastore: Datastore, queries: QueryEncoder, reader: ContextReader, vocab: list[str]
) -> Answerer:
    """Tokens for a single-piece datastore; whole words (`bertknn.service.words`) for a whole-word one."""
    if datastore.whole_words:
        return WordAnswerer(encoder, datastore, queries, reader)
    return TokenAnswerer(vocab, reader, non_words=encoder.words.vocab.non_words)


def opened(datastore_dir: Path | str) -> Datastore:
    """The datastore the service is to answer from, its build's warnings logged (a truncated dump, no context)."""
    datastore = Datastore(datastore_dir)
    for line in datastore.manifest.warnings:
        logger.warning("datastore %s: %s", datastore_dir, line)
    return datastore


class AnswerPipeline:
    """One datastore version and the model: answers cloze queries synchronously, stage by stage."""

    def __init__(
        self,
        encoder: QueryModel,
        datastore: Datastore,
        *,
        cache: Cache | None = None,
        key_prefix: str = "bertknn",
        mlm_top_entries: int = 2048,
        retrievers: dict[str, Retriever] | None = None,
        subjects: SubjectResolver | None = None,
        global_knn_factory: Callable[[], GlobalKnn] | None = None,
        answerer: Answerer | None = None,
    ):
        check_compatible(encoder, datastore)
        self.encoder = encoder
        self.datastore = datastore
        self.cache: Cache = cache if cache is not None else InMemoryCache()
        self.key_prefix = key_prefix
        self.mlm_top_entries = mlm_top_entries
        self.queries = QueryEncoder(encoder, self.cache, key_prefix=key_prefix, mlm_top_entries=mlm_top_entries)
        self.retrievers: dict[str, Retriever] = retrievers if retrievers is not None else open_retrievers(datastore)
        self.articles = ArticleFinder(
            datastore, self.cache, key_prefix=key_prefix, retrievers=self.retrievers,
            subjects=subjects if subjects is not None else SubjectResolver(datastore),
        )  # fmt: skip
        self.neighbours_of = NeighbourFinder(datastore, global_knn_factory=global_knn_factory)
        self.reader = ContextReader(datastore)
        self.vocab = vocabulary(encoder)
        self.answerer: Answerer = answerer or default_answerer(encoder, datastore, self.queries, self.reader, self.vocab)
        self.entity_answerer: EntityAnswerer | None = None
        if datastore.linked:
            words = self.words or WordAnswerer(encoder, datastore, self.queries, self.reader)
            self.entity_answerer = EntityAnswerer(datastore, words, self.reader)
        self.assembler = AnswerAssembler(
            datastore, self.articles, self.neighbours_of, self.answerer, self.entity_answerer, self.vocab
        )

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
        mlm_head: MlmHeadPolicy = "required",
        vocab_cache: VocabCache | None = None,
        encoder: QueryModel | None = None,
    ) -> AnswerPipeline:
        """Load and check everything once: datastore (validated), model (hash-checked), indexes, JVM.

        ``vocab_cache``: where the vocabulary's word table is kept across processes (`bertknn.core.vocab_cache`);
        None makes it here. ``encoder``: a model loaded elsewhere (the split layout's model process), checked
        against the datastore as one loaded here would be."""
        problems = validate_datastore(datastore_dir, hashes=verify_checksums, deep=verify_checksums)
        if problems:
            raise DatastoreError(f"datastore failed validation: {problems[0]}")
        datastore = opened(datastore_dir)
        man = datastore.manifest
        if encoder is None:
            name = locate_model(man.model.name, man.model.path, model)
            encoder = MaskedLMEncoder.load(
                name, layer=man.layer, device=device, dtype=dtype, max_seq_len=man.max_seq_len, mlm_head=mlm_head
            )
        if vocab_cache is not None:
            encoder.words.vocab = vocab_cache.words(encoder.words)
        return cls(encoder, datastore, cache=cache, key_prefix=key_prefix, mlm_top_entries=mlm_top_entries)

    def for_datastore(self, datastore_dir: Path | str, *, verify_checksums: bool = False) -> AnswerPipeline:
        """A pipeline over another datastore (a new version of this one) that shares this one's model and cache.

        The model is not loaded again; the datastore is validated and must have been built with the same model
        weights (`ModelLoadError` otherwise), its indexes are opened here. Used by the service's live reload.
        """
        problems = validate_datastore(datastore_dir, hashes=verify_checksums, deep=verify_checksums)
        if problems:
            raise DatastoreError(f"datastore failed validation: {problems[0]}")
        return type(self)(
            self.encoder,
            opened(datastore_dir),
            cache=self.cache,
            key_prefix=self.key_prefix,
            mlm_top_entries=self.mlm_top_entries,
        )

    @property
    def local_encoder(self) -> MaskedLMEncoder:
        """The model as loaded in this process (evaluation and benchmarks set its backend); `ModelLoadError` where
        another process runs it (the split layout's API processes)."""
        if not isinstance(self.encoder, MaskedLMEncoder):
            raise ModelLoadError(f"the model {self.encoder.name!r} runs in another process, not in this one")
        return self.encoder

    def identity(self) -> dict[str, dict[str, object]]:
        """The model and datastore this pipeline answers with (every response carries it): made once."""
        return dict(self._identity)

    @cached_property
    def _identity(self) -> dict[str, dict[str, object]]:
        man = self.datastore.manifest
        return {
            "model": {
                "name": public_model_name(self.encoder.name),
                "weights_sha256": self.encoder.weights_sha256,
                "layer": self.encoder.layer,
                "num_layers": self.encoder.num_layers,
            },
            "datastore": {
                "id": man.datastore_id,
                "version": man.version,
                "articles": man.counts.articles,
                "contexts": man.counts.contexts,
                "model_name": public_model_name(man.model.name),
            },
        }

    # ---- the stages, one call each (the async server runs them on its own threads) -------------------------

    def check_query(self, query: Query) -> MaskedInput:
        """Tokenise and check one query; `QueryError` says what to fix."""
        if query.subject is not None and not query.subject.strip():
            raise QueryError("subject: blank; give its article's title, or leave subject out to let the retriever "
                             "rank the articles")
        if query.answer == "entity":
            if not self.datastore.links.has_entities:
                raise QueryError(f"answer 'entity' needs entity links, and {NO_LINKS}; or ask for answer 'word'")
            if query.retriever == "none":
                raise QueryError("answer 'entity' searches the retrieved articles' links: use retriever bm25 or tfidf")
        return self.encoder.query_input(query.text)

    def fill_names(self, requests: Sequence[tuple[str, Sequence[str]]], deadline: float | None = None) -> list[list[float]]:
        """p_MLM of several questions' entity names from one fill pass (`EntityAnswerer.fill_names`)."""
        if self.entity_answerer is None:
            raise QueryError(f"entity names are scored on datastores with entity links, and {NO_LINKS}")
        return self.entity_answerer.fill_names(requests, deadline)

    def token(self, token_id: int) -> str:
        """The vocabulary's spelling of a token id."""
        return self.vocab[token_id]

    @property
    def words(self) -> WordAnswerer | None:
        """The whole-word answerer, when this datastore's answers are words."""
        return self.answerer if isinstance(self.answerer, WordAnswerer) else None

    def fill_answerers(self) -> list[WordAnswerer]:
        """The answerers that run fill passes of their own (whole words, entity names)."""
        found = [w for w in (self.words, self.entity_answerer.words if self.entity_answerer else None) if w is not None]
        return list({id(w): w for w in found}.values())

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
        encs, hits = self.queries.encode(inputs)
        embed_s = time.perf_counter() - t1
        answers = []
        for q, inp, enc, hit in zip(queries, inputs, encs, hits, strict=True):
            stage = Stage()
            stage.add("embedding", embed_s / max(1, len(queries)))
            answers.append(self.assembler.answer_from_encoding(
                q, enc, "hit" if hit else "miss", stage, with_distributions=with_distributions, cut=inp.cut
            ))  # fmt: skip
        total_ms = round((time.perf_counter() - t0) * 1000, 3)
        for answer in answers:  # the batch's wall time, as the service's total is the request's
            answer.timings_ms["total"] = total_ms
        logger.debug("batch of %d answered in %.1f ms", len(queries), total_ms)
        return answers

    def predict(self, query: Query, *, with_distributions: bool = False) -> Answer:
        return self.predict_batch([query], with_distributions=with_distributions)[0]

    def release(self) -> None:
        """Close what belongs to this datastore version (its retrievers), not the shared model or cache."""
        for r in self.retrievers.values():
            close = getattr(r, "close", None)
            if close:
                close()

    def close(self) -> None:
        self.release()
        self.cache.close()


# dtypes whose datastores any of them may serve: their answers were measured to agree (docs/decisions/numerics.md)
SERVABLE_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def check_numerics(built: str | None, served: str) -> None:
    """A datastore embedded in one of `SERVABLE_DTYPES` is served by a forward in any of them (any backend); one
    embedded in another dtype is refused (its vectors may differ beyond the measured rounding). The backend is
    chosen later (`prepare_forward`): the service's start-up log names the numerics it serves with."""
    if built is None or built == served:
        return
    dtype = built.split("/", 1)[0]
    if dtype not in SERVABLE_DTYPES or served.split("/", 1)[0] not in SERVABLE_DTYPES:
        raise ModelLoadError(
            f"this datastore was embedded as {built} and would be served as {served}: only "
            f"{', '.join(sorted(SERVABLE_DTYPES))} are known to give the same answers (docs/decisions/numerics.md); "
            "serve it in the dtype it was built with (model.dtype), or rebuild it"
        )


def check_compatible(encoder: QueryModel, datastore: Datastore) -> None:
    """Refuse a model that is not the one the datastore was built with, or a layer it does not have."""
    man = datastore.manifest
    if man.model.weights_sha256 != encoder.weights_sha256:
        raise ModelLoadError(
            f"model {encoder.name!r} (weights sha256 {encoder.weights_sha256[:12]}...) is not the model this datastore "
            f"was built with: {man.model.name!r} ({man.model.weights_sha256[:12]}...). Serve it with that model, or "
            "rebuild the datastore with this one."
        )
    if man.model.name != encoder.name:
        logger.info(
            "model loaded as %r, manifest names %r: same weights (sha256 match)", encoder.name, man.model.name
        )
    check_numerics(man.model.numerics, encoder.numerics)
    if not 0 <= man.layer <= encoder.num_layers:
        raise ModelLoadError(f"datastore layer {man.layer} is out of range for a {encoder.num_layers}-layer model")
    if encoder.layer != man.layer:
        raise ModelLoadError(f"encoder layer {encoder.layer} != datastore layer {man.layer}")
    if man.model.hidden_size != encoder.hidden_size or man.model.vocab_size != encoder.vocab_size:
        raise ModelLoadError("model hidden size or vocabulary differs from the datastore's")
