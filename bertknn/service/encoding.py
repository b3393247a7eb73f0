"""The cached forward pass: a query's embedding and p_MLM head, from the cache or one batched forward pass."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from bertknn.core.errors import CorruptCacheValue
from bertknn.core.inputs import MaskedInput
from bertknn.core.query_model import QueryModel, heads
from bertknn.core.topk import top_set
from bertknn.service.cache import Cache, InMemoryCache, cache_key, count_corrupt, count_hits
from bertknn.service.codec import QueryEncoding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingEncoding:
    """A query's forward-pass output before its p_MLM head is kept: `AnswerPipeline.complete` makes the
    `QueryEncoding`. (The service selects the head off the model's thread when the model has other work.)"""

    key: str  # the encoding's cache key
    embedding: np.ndarray  # float32 [hidden]
    log_probs: np.ndarray  # float32 [vocab], log p_MLM at the mask


class QueryEncoder:
    """Embeddings and p_MLM heads of queries: cache first, one batched forward pass for the misses."""

    def __init__(self, encoder: QueryModel, cache: Cache, *, key_prefix: str, mlm_top_entries: int):
        self.encoder = encoder
        self.cache = cache
        self.key_prefix = key_prefix
        self.mlm_top_entries = mlm_top_entries

    def key(self, inp: MaskedInput) -> str:
        """The cache key of a query's encoding (computed once per request: the service carries it along)."""
        enc = self.encoder
        return cache_key(self.key_prefix, "enc", enc.weights_sha256, enc.numerics, enc.layer, inp.input_ids)

    def _lookup(self, keys: Sequence[str]) -> list[QueryEncoding | None]:
        """The cached encodings: objects as they are in an in-process cache, else decoded (and checked) bytes."""
        if isinstance(self.cache, InMemoryCache):
            # a copy each: what one request derives from it (`p_mlm`) stays with that request
            return [v.bare() if isinstance(v, QueryEncoding) else None for v in self.cache.get_objects(keys)]
        return [self._decode(raw) for raw in self.cache.get_many(keys)]

    def _decode(self, raw: bytes | None) -> QueryEncoding | None:
        if raw is None:
            return None
        try:
            return QueryEncoding.from_bytes(raw, hidden=self.encoder.hidden_size, vocab_size=self.encoder.vocab_size)
        except CorruptCacheValue as exc:
            count_corrupt(self.cache)
            logger.warning("corrupt cache value ignored (%s)", exc)
            return None

    def local_encoding(self, key: str) -> QueryEncoding | None:
        """The cached encoding under ``key`` when the cache lives in this process (a dictionary look-up, safe on
        the event loop); None on a miss, or when the cache is remote (Redis: looked up with the batch instead)."""
        if not self.cache.in_process:
            return None
        enc = self._lookup([key])[0]
        if enc is not None:
            count_hits(self.cache, 1, 0)
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
        defer_heads: bool = False,
        keys: Sequence[str] | None = None,
        missed: bool = False,
    ) -> tuple[list[QueryEncoding | PendingEncoding], list[bool]]:
        """`encode`; ``defer_heads`` lets the misses come back as `PendingEncoding`s, whose p_MLM heads `complete`
        selects later, on another thread (the model's thread is then free for the next batch). Where the heads
        are picked on the device (`MaskedLMEncoder.heads_on_device`) there is nothing to defer: every miss comes
        back complete.

        ``keys``: the inputs' cache keys when the caller has them (`key`); ``missed``: the caller found none of
        them in this in-process cache just before (`local_encoding`), so they are not looked up again."""
        keys = list(keys) if keys is not None else [self.key(x) for x in inputs]
        out: list[QueryEncoding | PendingEncoding | None] = (
            [None] * len(keys) if missed and self.cache.in_process else list(self._lookup(keys))
        )
        hits = [enc is not None for enc in out]
        todo = [i for i, enc in enumerate(out) if enc is None]
        if todo and self.encoder.heads_on_device:  # the heads picked on the GPU: only they reach the host
            made = dict(zip([keys[i] for i in todo], self.uncached([inputs[i] for i in todo]), strict=True))
            self._store(made, defer_store)
            for i in todo:
                out[i] = made[keys[i]]
        elif todo:
            result = self.encoder.encode([inputs[i] for i in todo], with_mlm=True)
            assert result.mlm_log_probs is not None
            rows = result.mlm_log_probs.numpy()
            pending = [PendingEncoding(keys[i], result.embeddings[j], rows[j]) for j, i in enumerate(todo)]
            # unless deferred, the heads are kept here, on the calling (model) thread
            fresh: Sequence[QueryEncoding | PendingEncoding] = (
                pending if defer_heads else self._complete_all(pending, defer_store)
            )
            for i, enc in zip(todo, fresh, strict=True):
                out[i] = enc
        count_hits(self.cache, sum(hits), len(hits) - sum(hits))
        return [e for e in out if e is not None], hits

    def uncached(self, inputs: Sequence[MaskedInput]) -> list[QueryEncoding]:
        """The inputs' encodings from one forward pass, neither looked up in the cache nor kept there."""
        emb, values, ids = heads(self.encoder, inputs, self.mlm_top_entries)
        return [QueryEncoding.from_top(emb[j], values[j], ids[j], self.encoder.vocab_size) for j in range(len(inputs))]

    def complete(
        self, pending: PendingEncoding, *, defer_store: list[Callable[[], None]] | None = None
    ) -> QueryEncoding:
        """The `QueryEncoding` of a `forward(..., defer_heads=True)` miss: the same one `encode` makes, and
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
        if isinstance(cache, InMemoryCache):  # kept as objects, without what a request computed from them
            cache.set_objects({key: enc.bare() for key, enc in fresh.items()})
            return

        def store() -> None:
            cache.set_many({key: enc.to_bytes() for key, enc in fresh.items()})

        if defer_store is None or cache.in_process:
            store()
        else:
            defer_store.append(store)
