"""Build progress: a bar on a terminal, else a log line at a steady interval (contexts, contexts/s, ETA)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from tqdm import tqdm

from bertknn.builder.stages import StageTimes

logger = logging.getLogger("bertknn.builder")


class BuildProgress:
    """Counts embedded contexts and finished articles. On a TTY it drives a tqdm bar; otherwise (a log file, a
    container, CI) it logs one line every ``interval_s`` seconds, so a long build is never silent.

    ``total_articles``: when known (``--limit-articles``), the ETA is taken from the share of articles done.
    """

    def __init__(
        self,
        *,
        interval_s: float = 30.0,
        total_articles: int | None = None,
        stream: TextIO | None = None,
        stages: StageTimes | None = None,
        workers: int = 0,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.total_articles = total_articles
        self.stages = stages
        self.workers = workers
        self.contexts = 0
        self.articles = 0
        self.shards = 0
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._bar = tqdm(desc="contexts", unit="ctx", dynamic_ncols=True, file=self.stream) if self.interactive else None

    def embedded(self, rows: int) -> None:
        """``rows`` more contexts went through the model."""
        self.contexts += rows
        if self._bar is not None:
            self._bar.update(rows)
        else:
            self._maybe_log()

    def shard_written(self, articles: int) -> None:
        self.shards += 1
        self.articles += articles
        self._maybe_log()

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.t0)
        rate = self.contexts / elapsed
        eta = "unknown (streamed corpus; --limit-articles gives one)"
        if self.total_articles and self.articles:
            left = max(0, self.total_articles - self.articles) * elapsed / self.articles
            eta = f"{left / 60:.1f} min"
        stages = f"; {self.stages.line(self.workers)}" if self.stages is not None else ""
        return (
            f"progress: {self.contexts:,} contexts, {self.articles:,} articles in {self.shards} shards, "
            f"{rate:.1f} contexts/s, {elapsed / 60:.1f} min elapsed, ETA {eta}{stages}"
        )

    def _maybe_log(self) -> None:
        if self._bar is not None:
            return
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._last_log = now
            logger.info(self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.contexts:
            logger.info(self.line())
