"""Whether a datastore can answer in its language at all: the share of its contexts that are word answers, and the
warnings a build records when that share, or the share of sentences it kept, says the corpus's rules did not fit,
or when it stored no context at all."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from bertknn.core.format.contract import Counts, Manifest, ShardInfo
from bertknn.core.words import MAX_WORD_PIECES

# below these, a datastore mostly cannot answer: its language's rules (words, sentences) did not fit the corpus
MIN_WORD_TARGET_SHARE = 0.10
MAX_DROPPED_SHARE = 0.50
# below this share of its words kept as targets, a corpus's language is one the model's tokenizer barely knows;
# fewer words than MIN_WORDS_SEEN say too little to tell
MIN_WORD_SHARE = 0.20
MIN_WORDS_SEEN = 500


def word_target_share(root: Path, manifest: Manifest) -> float | None:
    """The share of stored contexts whose label is a word (not only an entity link's anchor); None without rows."""
    from bertknn.core.format.reader import Datastore

    ds = Datastore(root, manifest)
    try:
        rows = ds.total_rows
        if not rows:
            return None
        words = sum(int(np.count_nonzero(np.asarray(shard.labels) >= 0)) for shard in ds.shards)
    finally:
        ds.close()
    return words / rows


def target_warning(share: float | None) -> str | None:
    if share is None or share >= MIN_WORD_TARGET_SHARE:
        return None
    return (
        f"only {share:.1%} of the stored contexts are word answers (the rest are entity links' anchors): the "
        "model's tokenizer and the corpus's language do not fit (check --language, or use a model whose "
        "tokenizer knows this language's words)"
    )


def vocabulary_warning(words: int, targets: int, mode: str, language: str) -> str | None:
    """Few of the corpus's words (``targets`` of ``words`` that could be targets) are words the model's tokenizer
    spells as one token (``whole-word``: at most MAX_WORD_PIECES tokens): it does not know the corpus's language,
    and the datastore keeps few contexts. None when enough are, or too few words were seen to tell."""
    if words < MIN_WORDS_SEEN or targets >= MIN_WORD_SHARE * words:
        return None
    single = mode == "single-piece"
    what = "one token" if single else f"at most {MAX_WORD_PIECES} tokens"
    more = "; or --targets whole-word, which keeps words of several tokens" if single else ""
    return (
        f"only {targets / words:.1%} of the corpus's words (stopwords and punctuation aside) are {what} of this "
        f"model's tokenizer, and only those become contexts: the tokenizer barely knows the corpus's language "
        f"({language!r}); a model trained on that language keeps more{more}"
    )


_EMPTY = "the datastore holds "  # how `empty_warning`'s lines start


def with_empty_warning(warnings: list[str], counts: Counts) -> list[str]:
    """A manifest's warnings with `empty_warning` made true for ``counts`` (an ``add`` or a merge of slices may
    have filled a datastore that a build left empty)."""
    kept = [w for w in warnings if not w.startswith(_EMPTY)]
    found = empty_warning(counts)
    return [*kept, found] if found else kept


def empty_warning(counts: Counts) -> str | None:
    """A datastore without a stored context answers from the model alone: say why it has none."""
    if counts.contexts:
        return None
    model_alone = "its answers are the model's alone until `bert-knn add` adds articles"
    if not counts.articles:
        return (
            f"{_EMPTY}no article: the corpus gave none (redirects, pages of other namespaces and "
            f"{counts.skipped_pages:,} disambiguation or list pages were left out); {model_alone}"
        )
    return (
        f"{_EMPTY}{counts.articles:,} articles but no context: none of their {counts.sentences:,} kept "
        f"sentences has a word to mask (check --language, and that the model's tokenizer knows the corpus's "
        f"words); {model_alone}"
    )


def dropped_warning(dropped: dict[str, int], kept: int) -> str | None:
    total = sum(dropped.values()) + kept
    if not total or sum(dropped.values()) / total <= MAX_DROPPED_SHARE:
        return None
    reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(dropped.items(), key=lambda kv: -kv[1]))
    return (
        f"{sum(dropped.values()) / total:.0%} of the sentences were dropped ({reasons}); the corpus's language rules "
        "may not fit it (check --language; a JSON lines corpus is read as English unless told)"
    )


def dropped_in(shards: list[ShardInfo]) -> dict[str, int]:
    """The sentences the shards' articles left out, by reason (each part counts its own: a resumed or sliced
    build sums the same as one run)."""
    return summed(info.dropped for info in shards)


def summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Counts by reason, added up, sorted by reason."""
    out: dict[str, int] = {}
    for one in counts:
        for reason, n in one.items():
            out[reason] = out.get(reason, 0) + n
    return dict(sorted(out.items()))
