"""Build progress: a bar on a terminal, else a log line at a steady interval (contexts, contexts/s, ETA)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from bertknn.builder.stages import StageTimes
from bertknn.core.logs import Event

logger = logging.getLogger("bertknn.builder")


class BuildProgress:
    """Counts articles and contexts as they are prepared, contexts as they are embedded, and parts as they are
    written. On a TTY it drives a tqdm bar; otherwise (a log file, a container, CI) it logs one line every
    ``interval_s`` seconds, so a long build is never silent.

    The ETA: ``total_articles`` (``--limit-articles``) when known, else ``read_fraction`` (the share of the corpus
    files' stored bytes read so far). The work still to do is estimated in contexts (those prepared so far, scaled
    by the share read), so that reading ahead of the model does not make the ETA look shorter than it is.
    """

    def __init__(
        self,
        *,
        interval_s: float = 30.0,
        total_articles: int | None = None,
        stream: TextIO | None = None,
        stages: StageTimes | None = None,
        workers: int = 0,
        read_fraction: Callable[[], float | None] | None = None,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.total_articles = total_articles
        self.read_fraction = read_fraction
        self.stages = stages
        self.workers = workers
        self.contexts = 0  # embedded
        self.prepared_contexts = 0
        self.articles = 0  # prepared (read, split and tokenised)
        self.shards = 0
        self.kept = 0  # contexts of the finished parts a resumed build skips
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._bar = tqdm(desc="contexts", unit="ctx", dynamic_ncols=True, file=self.stream) if self.interactive else None

    def prepared(self, articles: int, contexts: int) -> None:
        """``articles`` more articles, holding ``contexts`` contexts, are ready for the model."""
        self.articles += articles
        self.prepared_contexts += contexts
        if self._bar is not None and (total := self.total_contexts()) is not None:
            self._bar.total = max(int(total), self.contexts)
            self._bar.refresh()

    def resumed(self, articles: int, contexts: int) -> None:
        """Finished parts of an earlier run, skipped: they count toward the whole, not toward the rate."""
        self.articles += articles
        self.prepared_contexts += contexts
        self.kept += contexts

    def carried(self, rows: int) -> None:
        """Contexts an interrupted run embedded past its last whole article, taken up: done, not toward the rate."""
        self.kept += rows

    def embedded(self, rows: int) -> None:
        """``rows`` more contexts went through the model."""
        self.contexts += rows
        if self._bar is not None:
            self._bar.update(rows)
        else:
            self._maybe_log()

    def shard_written(self, articles: int) -> None:
        self.shards += 1
        self._maybe_log()

    def total_contexts(self) -> float | None:
        """The contexts the whole build will hold, estimated from what was prepared and how much of it is read."""
        share = None
        if self.total_articles:
            share = min(1.0, self.articles / self.total_articles)
        elif self.read_fraction is not None:
            share = self.read_fraction()
        if not share or not self.prepared_contexts:
            return None
        return self.prepared_contexts / share

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None: not known yet)."""
        total = self.total_contexts()
        if total is None or not self.contexts:
            return None
        elapsed = time.monotonic() - self.t0
        return max(0.0, total - self.kept - self.contexts) * elapsed / self.contexts

    def eta(self) -> str:
        left, total = self.eta_s(), self.total_contexts()
        if left is None or total is None:
            return "after the first contexts" if self.total_articles or self.read_fraction else "unknown"
        basis = "--limit-articles" if self.total_articles else "the share of the corpus read"
        return f"{left / 60:.1f} min (of about {total:,.0f} contexts; from {basis})"

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.t0)
        rate = self.contexts / elapsed
        stages = f"; {self.stages.line(self.workers)}" if self.stages is not None else ""
        return (
            f"progress: {self.contexts:,} contexts embedded of {self.prepared_contexts:,} prepared from "
            f"{self.articles:,} articles, {self.shards} parts written, {rate:.1f} contexts/s, "
            f"{elapsed / 60:.1f} min elapsed, ETA {self.eta()}{stages}"
        )

    def event(self) -> Event:
        """The progress line, with its figures as fields for a JSON log (``BERTKNN_LOG_FORMAT=json``)."""
        elapsed = max(1e-9, time.monotonic() - self.t0)
        left, total = self.eta_s(), self.total_contexts()
        fields: dict[str, object] = {
            "contexts": self.contexts,
            "prepared_contexts": self.prepared_contexts,
            "articles": self.articles,
            "parts": self.shards,
            "contexts_per_s": round(self.contexts / elapsed, 1),
            "elapsed_s": round(elapsed, 1),
            "eta_s": None if left is None else round(left, 1),
            "total_contexts_estimate": None if total is None else round(total),
        }
        if self.stages is not None:
            fields.update(self.stages.progress(self.workers))
        return Event("progress", fields, text=self.line())

    def _maybe_log(self) -> None:
        if self._bar is not None:
            return
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._last_log = now
            logger.info(self.event())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.contexts:
            logger.info(self.event())
