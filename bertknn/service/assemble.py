"""Everything after a query's forward pass: its articles, the restricted kNN, the vote and the interpolation."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import cached_property

from bertknn.core.calibration import AutoTemperature, temperature_for
from bertknn.core.format import Datastore
from bertknn.core.languages import script_warning
from bertknn.core.text import MASK_RE
from bertknn.service.answer import DEFAULT_RULE, Answerer, TokenAnswerer
from bertknn.service.codec import QueryEncoding
from bertknn.service.device_vote import Voted
from bertknn.service.entities import EntityAnswerer, entity_of_words
from bertknn.service.interpolate import knn_skipped
from bertknn.service.results import Answer, ArticleHit, Assembled, Query, Stage, Unvoted
from bertknn.service.retrieval.articles import ArticleFinder
from bertknn.service.retrieval.knn import EMPTY, ArticleSearch, Neighbours
from bertknn.service.retrieval.neighbours import NeighbourFinder

NO_CONTEXTS = "this datastore holds no context (its corpus gave none): the answer is the model's alone"


def subject_warnings(query: Query, status: str | None) -> list[str]:
    """What a response must say when its subject found no article: the answer came from other articles."""
    if status != "not_found":
        return []
    how = "the whole datastore was searched" if query.retriever == "none" else f"{query.retriever} ranked the articles"
    return [f"subject {query.subject!r} has no article in this datastore; {how} instead"]


def unvoted(query: Query, hits: list[ArticleHit], found: int) -> Unvoted | None:
    """Why no context voted in an answer whose kNN search ran over a datastore that has contexts and found
    ``found`` neighbours: no article matched the question (``no_article``), or the articles searched hold no
    context (for an entity answer, none that links an entity: ``no_context``); None when some voted."""
    if found:
        return None
    return "no_article" if query.retriever != "none" and not hits else "no_context"


def unvoted_warnings(query: Query, hits: list[ArticleHit], why: Unvoted | None) -> list[str]:
    """What a response must say when no context voted (`unvoted`): the answer is the model's alone, and why."""
    if why is None:
        return []
    if why == "no_article":
        return [f"{query.retriever} found no article for the question's words, so no context voted: the answer is "
                "the model's alone; name the question's subject, or use words its article uses"]
    where = "the subject's article holds" if any(h.rule == "subject" for h in hits) else "the articles searched hold"
    what = "context that links an entity" if query.answer == "entity" else "context"
    return [f"{where} no stored {what}, so no context voted: the answer is the model's alone"]


class AnswerAssembler:
    """A query's answer from its encoding, over one datastore version (`AnswerPipeline.assembler`)."""

    def __init__(
        self, datastore: Datastore, articles: ArticleFinder, neighbours_of: NeighbourFinder, answerer: Answerer,
        entity_answerer: EntityAnswerer | None, vocab: list[str],
    ):  # fmt: skip
        self.datastore = datastore
        self.articles = articles
        self.neighbours_of = neighbours_of
        self.answerer = answerer
        self.entity_answerer = entity_answerer
        self.vocab = vocab

    def skips_knn(self, query: Query, enc: QueryEncoding) -> bool:
        """Adaptive queries whose p_MLM is confident enough skip retrieval and kNN (decided from p_MLM alone)."""
        return query.interpolation == "adaptive" and knn_skipped(query.rule or DEFAULT_RULE, enc.p_mlm())

    @cached_property
    def auto_temperature(self) -> AutoTemperature:
        """What temperature ``auto`` stands for with this datastore (measured by its builder; else the paper's)."""
        return temperature_for(self.datastore.manifest.distance_scale)

    def resolve_temperature(self, query: Query, nbrs: Neighbours) -> Query:
        """``query`` with its temperature: its own, or for auto (None) the datastore's for these neighbours."""
        if query.temperature is not None:
            return query
        return replace(query, temperature=self.auto_temperature.of(nbrs.distances))

    def votes_on_device(self, query: Query) -> bool:
        """Whether a question searched on the device may be voted there too (`DeviceVote`): a word answer over
        the vocabulary's tokens, with the fixed interpolation."""
        return query.answer == "word" and query.interpolation == "fixed" and isinstance(self.answerer, TokenAnswerer)

    def answer(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], nbrs: Neighbours, *,
        with_distributions: bool = False, voted: Voted | None = None,
    ) -> Assembled:  # fmt: skip
        """``voted``: its rankings, made with its batch on the device (`DeviceVote`; a word answer over tokens)."""
        query = self.resolve_temperature(query, nbrs)
        if query.interpolation == "adaptive" and (query.rule or DEFAULT_RULE).popularity_weight and query.popularity is None:
            query = replace(query, popularity=self.subject_popularity(query.subject))
        if query.answer == "entity":
            assert self.entity_answerer is not None, "check_query refuses entity answers without links"
            return self.entity_answerer.answer(query, enc, articles, nbrs, with_distributions=with_distributions)
        if voted is not None and isinstance(self.answerer, TokenAnswerer) and not with_distributions:
            parts = self.answerer.from_voted(query, voted, nbrs, articles)
        else:
            parts = self.answerer.answer(query, enc, articles, nbrs, with_distributions=with_distributions)
        if not self.datastore.links.has_entities or not parts.predictions:  # (no entity to name: linked or not)
            return parts
        assert query.temperature is not None
        refs = entity_of_words(
            self.datastore, nbrs, [p.token for p in parts.predictions], self._neighbour_words(nbrs), query.temperature
        )
        preds = [p.with_entity(ref) for p, ref in zip(parts.predictions, refs, strict=True)]
        return replace(parts, predictions=preds)

    def subject_popularity(self, subject: str | None) -> int:
        """The inbound links of the subject's entity (0: no subject, no links, or none link to it)."""
        if not subject or not self.datastore.linked:
            return 0
        title = self.articles.subjects.resolve(subject) or subject
        ref = self.datastore.links.entity(title)
        return ref.popularity if ref is not None else 0

    def _neighbour_words(self, nbrs: Neighbours) -> list[str]:
        """The word stored at each neighbour rank, spelt as the answers spell it."""
        if self.datastore.whole_words:
            return [self.datastore.word_at(row).text for row in nbrs.rows.tolist()]
        vocab = self.vocab
        return [vocab[label] for label in nbrs.labels.tolist()]

    def language_warnings(self, text: str) -> list[str]:
        """A question in another script than the datastore's language's (`script_warning`)."""
        found = script_warning(MASK_RE.sub(" ", text), self.datastore.manifest.language)
        return [found] if found else []

    def window_warnings(self, cut: int) -> list[str]:
        """A question longer than the window its datastore's contexts were embedded in (``cut`` tokens left out)."""
        if not cut:
            return []
        window = self.datastore.manifest.max_seq_len
        return [f"the question is longer than this datastore's window of {window} tokens: the model read the "
                f"{window - 2} around [MASK] and left {cut} out (retrieval read all of it); a shorter question keeps "
                "what matters"]  # fmt: skip

    @cached_property
    def datastore_warnings(self) -> list[str]:
        """What every answer from this datastore must say: that it has no context to vote with."""
        return [] if self.datastore.manifest.counts.contexts else [NO_CONTEXTS]

    def answer_from_encoding(
        self,
        query: Query,
        enc: QueryEncoding,
        enc_cache: str,
        stage: Stage,
        *,
        articles: tuple[list[ArticleHit], str] | None = None,
        search: ArticleSearch | None = None,
        neighbours: Neighbours | None = None,
        voted: Voted | None = None,
        with_distributions: bool = False,
        cut: int = 0,
    ) -> Answer:
        """Everything after the forward pass: the retrieval (unless the caller already ran it: ``articles``), the
        restricted kNN search (over ``search``, the articles' rows, when the caller prepared them with
        `prepare_search`; or its result, ``neighbours``, when the caller searched already: `device_search`), the vote
        and the interpolation (or their result, ``voted``, when the device voted the batch: `device_search`). ``stage.times`` gets each stage's seconds; the caller
        adds ``total``, the wall time (stages may overlap).

        An adaptive query whose p_MLM is confident skips retrieval and kNN entirely (``articles`` is then
        ignored); its timings have no retrieval and no knn entry. ``cut``: the question's tokens that its input
        left out (`MaskedInput.cut`), which its warnings name.
        """
        skipped = self.skips_knn(query, enc)  # before any retrieval or kNN work
        hits: list[ArticleHit]
        if skipped:
            hits, ret_cache, nbrs = [], "none", EMPTY
        else:
            hits, ret_cache, nbrs = self._search(query, enc, stage, articles, search, neighbours)
        t = time.perf_counter()
        query = self.resolve_temperature(query, nbrs)
        assert query.temperature is not None
        parts = self.answer(query, enc, hits, nbrs, with_distributions=with_distributions, voted=voted)
        status = self.articles.subject_status(query)
        why = None if skipped or self.datastore_warnings else unvoted(query, hits, len(nbrs))
        stage.add("interpolation", time.perf_counter() - t)
        for name in ("embedding", "interpolation") if skipped else ("retrieval", "embedding", "knn", "interpolation"):
            stage.times.setdefault(name, 0.0)
        return Answer(
            parts.predictions,
            parts.mlm,
            parts.knn,
            parts.articles,
            parts.lambda_used,
            {k: round(v, 3) for k, v in stage.times.items()},
            {"encoding": enc_cache, "retrieval": ret_cache},
            parts.distributions,
            query.interpolation,
            skipped,
            status,
            query.temperature,
            [*subject_warnings(query, status), *self.language_warnings(query.text), *self.window_warnings(cut),
             *self.datastore_warnings, *unvoted_warnings(query, hits, why)],
            unvoted=why,
        )

    def _search(
        self, query: Query, enc: QueryEncoding, stage: Stage, articles: tuple[list[ArticleHit], str] | None,
        search: ArticleSearch | None, neighbours: Neighbours | None = None,
    ) -> tuple[list[ArticleHit], str, Neighbours]:
        """`answer_from_encoding`'s retrieval (unless the caller ran it) and kNN, each timed into ``stage``: the articles, how
        the retrieval cache answered, the neighbours."""
        t = time.perf_counter()
        if articles is None:
            articles = self.articles.retrieve(query)
            stage.add("retrieval", time.perf_counter() - t)
        hits, ret_cache = articles
        if neighbours is not None:  # (its time is in ``stage`` already)
            return hits, ret_cache, neighbours
        t = time.perf_counter()
        nbrs = self.neighbours_of.neighbours(query, enc, hits, search)
        stage.add("knn", time.perf_counter() - t)
        return hits, ret_cache, nbrs
