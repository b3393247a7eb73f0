"""Where a build's time goes: seconds and items per stage, so that a user sees which stage bounds the build.

Stages, in order: ``decompress`` (bytes read out of bz2/gzip, or the file), ``parse`` (XML or JSON: pages),
``markup`` (wikitext to text: articles), ``split`` (sentences), ``targets`` (target selection and tokenisation:
contexts), ``forward`` (the model: contexts), ``write`` (shard files: contexts). The first two run in the
reading process; markup, split and targets in the tokenising workers (in parallel); forward and write in the
main process (the write overlaps the next shard's forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("decompress", "parse", "markup", "split", "targets", "forward", "write")
UNITS = {"decompress": "bytes", "parse": "pages", "markup": "articles", "split": "sentences",
         "targets": "contexts", "forward": "contexts", "write": "contexts"}  # fmt: skip
WORKER_STAGES = ("markup", "split", "targets")


def _zeros() -> dict[str, float]:
    return dict.fromkeys(STAGES, 0.0)


@dataclass
class StageTimes:
    """Seconds and items per stage (picklable: workers send theirs back with each prepared shard)."""

    seconds: dict[str, float] = field(default_factory=_zeros)
    items: dict[str, float] = field(default_factory=_zeros)
    dropped: dict[str, int] = field(default_factory=dict)  # sentences left out, by reason (short, fragment, markup)
    worker_blocks: int = 0  # blocks whose worker stages were merged in (each prepared by one worker)
    tokens: int = 0  # tokens the forward passes embedded
    words: int = 0  # words of the kept sentences that are neither stopwords nor punctuation
    word_targets: int = 0  # those of them that are targets (one token; whole-word: at most MAX_WORD_PIECES)
    padded_tokens: int = 0  # the same batches' tokens with padding: rows x the longest row, per batch

    def pad(self, tokens: int, padded: int) -> None:
        """One forward batch: its real tokens and its padded size."""
        self.tokens += tokens
        self.padded_tokens += padded

    def padding_fraction(self) -> float | None:
        """The share of the forward's tokens that were padding (None before any batch)."""
        return round(1.0 - self.tokens / self.padded_tokens, 4) if self.padded_tokens else None

    def count_words(self, words: int, targets: int) -> None:
        """A sentence's words that could be targets, and those that are."""
        self.words += words
        self.word_targets += targets

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def add(self, stage: str, seconds: float, items: float = 0) -> None:
        self.seconds[stage] += seconds
        self.items[stage] += items

    def merge(self, other: StageTimes) -> None:
        self.pad(other.tokens, other.padded_tokens)
        self.count_words(other.words, other.word_targets)
        if any(other.seconds[s] for s in WORKER_STAGES):
            self.worker_blocks += max(1, other.worker_blocks)
        for reason, n in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n
        for s in STAGES:
            if other.seconds[s] or other.items[s]:  # (untouched stages stay untouched: the writer thread adds
                self.seconds[s] += other.seconds[s]  # its own stage meanwhile)
                self.items[s] += other.items[s]

    def wall(self, workers: int) -> dict[str, float]:
        """Seconds of wall time per stage: the workers' stages divided among them, or among as many as had a
        block to prepare when fewer blocks than workers were merged in (a small build keeps the others idle)."""
        share = max(1, min(workers, self.worker_blocks) if self.worker_blocks else workers)
        return {s: self.seconds[s] / (share if s in WORKER_STAGES else 1) for s in STAGES}

    def bound(self, workers: int) -> str:
        """The stage that took the most wall time: what bounds the build."""
        wall = self.wall(workers)
        return max(STAGES, key=lambda s: wall[s])

    def summary(self, workers: int) -> dict[str, object]:
        """Per stage: seconds (CPU-seconds summed over workers for theirs), items and items per second per
        worker process; and the bound."""
        stages = {}
        for s in STAGES:
            secs = self.seconds[s]
            stages[s] = {
                "seconds": round(secs, 3),
                UNITS[s]: int(self.items[s]),
                f"{UNITS[s]}_per_s_per_process": round(self.items[s] / secs, 1) if secs > 0 else None,
            }
        return {
            "stages": stages,
            "workers": workers,
            "bound": self.bound(workers),
            "sentences_dropped": dict(sorted(self.dropped.items())),
            "words": {"seen": self.words, "targets": self.word_targets},
            "padding_fraction": self.padding_fraction(),
        }

    def bound_so_far(self, workers: int) -> str | None:
        """The bound, or None before the first shard (the workers' and the model's times arrive with each one)."""
        return self.bound(workers) if self.seconds["forward"] > 0 else None

    def progress(self, workers: int) -> dict[str, object]:
        """What a progress line tells of the stages: each one's wall seconds so far, and the bound so far."""
        wall = self.wall(workers)
        stages = {s: round(wall[s], 1) for s in STAGES if self.seconds[s] > 0}
        return {"stages_wall_s": stages, "bound": self.bound_so_far(workers)}

    def line(self, workers: int) -> str:
        wall = self.wall(workers)
        parts = " ".join(f"{s} {wall[s]:.1f}s" for s in STAGES if self.seconds[s] > 0)
        return f"stages (wall): {parts}; bound: {self.bound_so_far(workers) or 'known after the first shard'}"
