"""Every server process runs a few questions of its own through its model, retrieval, kNN and vote before it says
it is ready, so that no client's request pays for what a process does once: the first forward pass at each batch
shape, kernels a GPU loads when first used, the first calls into the retriever, FAISS and numpy. With several
processes behind one port each warms itself. Nothing of it is kept: no cache entry, no metric."""

from __future__ import annotations

import itertools
import logging
import time

from bertknn.core.text import retrieval_text
from bertknn.service.answer import TokenAnswerer
from bertknn.service.api.routes import to_query
from bertknn.service.api.schemas import PredictRequest
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import ArticleHit, Query
from bertknn.service.settings import ServiceSettings

logger = logging.getLogger(__name__)
WORDS, CHARS = 12, 200  # of an article's text before the mask (CHARS: scripts written without spaces)
BATCH = 8  # questions of the batch after the first question alone


def warm_questions(pipeline: AnswerPipeline, settings: ServiceSettings, n: int) -> list[Query]:
    """Up to ``n`` questions from the datastore's first articles with text (the opening of each, then the mask), with
    the server's defaults, so that the retriever finds their articles."""
    mask = pipeline.encoder.tokenizer.mask_token
    openings = (" ".join(text.split()[:WORDS])[:CHARS] for _, text in pipeline.datastore.iter_article_texts())
    return [to_query(PredictRequest(text=f"{o} {mask} ."), settings) for o in itertools.islice(filter(None, openings), n)]


def warm_up(pipeline: AnswerPipeline, settings: ServiceSettings) -> int:
    """On the model's thread, before the process is ready: a question alone, then a batch, each the whole way
    past the caches; returns the questions that ran. A failure is logged and ends the warm-up, never the start."""
    t, done = time.perf_counter(), 0
    try:
        questions = warm_questions(pipeline, settings, 1 + BATCH)
        for group in (questions[:1], questions[1:]):
            encodings = pipeline.queries.uncached([pipeline.check_query(q) for q in group])
            for query, enc in zip(group, encodings, strict=True):
                hits = _articles(pipeline, query)
                nbrs = pipeline.neighbours_of.neighbours(query, enc, hits)
                if isinstance(pipeline.answerer, TokenAnswerer) and query.answer == "word":  # (whole words: fills)
                    pipeline.assembler.answer(query, enc, hits, nbrs)
                done += 1
    except Exception as exc:  # (e.g. a datastore without the default retriever's index)
        logger.warning("warm-up stopped after %d questions: %s", done, exc)
    logger.info("warmed up with %d questions in %.2f s", done, time.perf_counter() - t)
    return done


def _articles(pipeline: AnswerPipeline, query: Query) -> list[ArticleHit]:
    """The ranker's articles for ``query``, not looked up in the cache nor kept there."""
    ranker = pipeline.articles.retrievers.get(query.retriever)
    if ranker is None:
        return []
    found = ranker.top_articles(retrieval_text(query.text), query.num_articles)
    return [ArticleHit(title, float(score), query.retriever) for title, score in found]
