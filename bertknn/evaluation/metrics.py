"""P@k from gold ranks: per relation, macro averages per dataset and overall, micro for comparison, the table.

Macro is LAMA's: P@k is computed per relation first, then averaged across relations, so every relation weighs
the same whatever its number of facts. "Overall" is the mean over all relations of all datasets (not the mean
of the dataset means). Precisions are percentages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bertknn.evaluation.lama import DATASETS

COLUMNS: tuple[str, ...] = ("mlm", "knn", "bert_knn")
ADAPTIVE = "bert_knn_adaptive"  # the interpolation with the adaptive rule's lambda (evaluation --adaptive)
OPTIONAL_COLUMNS: tuple[str, ...] = (ADAPTIVE,)
KS: tuple[int, ...] = (1, 5, 10)

Precisions = dict[str, float]  # {"p@1": .., "p@5": .., "p@10": ..}


@dataclass(frozen=True)
class QueryResult:
    """The gold object's 1-based rank under each distribution (None: probability 0, i.e. never predicted)."""

    relation: str
    dataset: str
    uid: str
    mlm: int | None
    knn: int | None
    bert_knn: int | None
    top: tuple[str, str, str] = ("", "", "")  # top-1 token of mlm, knn, bert_knn (for the predictions file)
    bert_knn_adaptive: int | None = None  # rank under the adaptive rule's interpolation (when evaluated)
    knn_skipped: bool | None = None  # the adaptive rule answered from p_MLM alone (None: not evaluated)
    lambda_adaptive: float | None = None
    # whether the fact's subject has an article in the datastore (its own, a redirect's or a folded title's),
    # which is then the one article searched; None: not known (the fact names no subject)
    subject_found: bool | None = None

    def rank(self, column: str) -> int | None:
        if column not in COLUMNS + OPTIONAL_COLUMNS:
            raise KeyError(f"unknown column {column!r}; one of {COLUMNS + OPTIONAL_COLUMNS}")
        return getattr(self, column)


@dataclass(frozen=True)
class RelationScore:
    relation: str
    dataset: str
    facts: int
    columns: dict[str, Precisions]
    subjects_found: int | None = None  # facts whose subject has an article (None: its facts name no subject)


@dataclass(frozen=True)
class DatasetScore:
    dataset: str
    relations: int
    facts: int
    columns: dict[str, Precisions]
    subjects_found: int | None = None


@dataclass(frozen=True)
class Summary:
    relations: list[RelationScore]
    datasets: list[DatasetScore]
    overall: dict[str, Precisions]  # macro over all relations of all datasets
    micro: dict[str, Precisions]  # over all queries, for comparison only
    columns: tuple[str, ...] = COLUMNS

    @property
    def facts(self) -> int:
        return sum(r.facts for r in self.relations)

    @property
    def subjects(self) -> tuple[int, int] | None:
        """Facts whose subject has an article in the datastore, and the facts of the relations that name a
        subject, over all relations (None: no relation names one)."""
        known = [r for r in self.relations if r.subjects_found is not None]
        return (found_in(known) or 0, sum(r.facts for r in known)) if known else None


def found_in(scores: Sequence[RelationScore]) -> int | None:
    """The facts whose subject has an article, summed over ``scores`` (None: none of them names a subject)."""
    found = [s.subjects_found for s in scores if s.subjects_found is not None]
    return sum(found) if found else None


def subjects_found(results: Sequence[QueryResult]) -> int | None:
    """How many of ``results`` had their subject's article (None: none of them names a subject)."""
    flags = [r.subject_found for r in results if r.subject_found is not None]
    return sum(flags) if flags else None


def precision_at(ranks: Sequence[int | None], k: int) -> float:
    """Percentage of ranks that are <= k (None never counts)."""
    if not ranks:
        raise ValueError("precision of an empty set of queries is undefined")
    return 100.0 * sum(1 for r in ranks if r is not None and r <= k) / len(ranks)


def precisions(ranks: Sequence[int | None], ks: Sequence[int] = KS) -> Precisions:
    return {f"p@{k}": precision_at(ranks, k) for k in ks}


def mean_precisions(items: Sequence[Mapping[str, float]]) -> Precisions:
    """Key-wise mean of several {"p@k": value} dicts (the macro step)."""
    if not items:
        raise ValueError("no relations to average")
    return {key: sum(it[key] for it in items) / len(items) for key in items[0]}


def score_relations(results: Iterable[QueryResult], columns: Sequence[str] = COLUMNS) -> list[RelationScore]:
    """P@k per relation and column, relations in first-seen order."""
    groups: dict[str, list[QueryResult]] = {}
    datasets: dict[str, str] = {}
    for r in results:
        groups.setdefault(r.relation, []).append(r)
        datasets.setdefault(r.relation, r.dataset)
    return [
        RelationScore(
            rel, datasets[rel], len(rs), {c: precisions([r.rank(c) for r in rs]) for c in columns}, subjects_found(rs)
        )
        for rel, rs in groups.items()
    ]


def macro(scores: Sequence[RelationScore]) -> dict[str, Precisions]:
    return {c: mean_precisions([s.columns[c] for s in scores]) for c in scores[0].columns}


def micro(results: Sequence[QueryResult], columns: Sequence[str] = COLUMNS) -> dict[str, Precisions]:
    return {c: precisions([r.rank(c) for r in results]) for c in columns}


def summarize(results: Sequence[QueryResult]) -> Summary:
    """P@k of every column; the adaptive column too when the results carry it."""
    if not results:
        raise ValueError("no query was evaluated: every fact was filtered out (see the filter counts)")
    columns = COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if _evaluated(results, c))
    scores = score_relations(results, columns)
    order = {d: i for i, d in enumerate(DATASETS)}
    names = sorted({s.dataset for s in scores}, key=lambda d: (order.get(d, len(order)), d))
    datasets = []
    for name in names:
        mine = [s for s in scores if s.dataset == name]
        datasets.append(DatasetScore(name, len(mine), sum(s.facts for s in mine), macro(mine), found_in(mine)))
    return Summary(scores, datasets, macro(scores), micro(results, columns), columns)


def _evaluated(results: Sequence[QueryResult], column: str) -> bool:
    if column == ADAPTIVE:
        return all(r.knn_skipped is not None for r in results)
    return True


def skipped_fraction(results: Sequence[QueryResult]) -> float:
    """Share of queries whose kNN search the adaptive rule skipped (the MLM alone was confident enough)."""
    flags = [r.knn_skipped for r in results if r.knn_skipped is not None]
    if not flags:
        raise ValueError("the adaptive rule was not evaluated on these results")
    return sum(flags) / len(flags)


def _rounded(p: Precisions) -> Precisions:
    return {k: round(v, 2) for k, v in p.items()}


def report_dict(summary: Summary, settings: Mapping[str, object]) -> dict:
    """The ``--out`` JSON: {"macro", "datasets", "relations", "settings"}, precisions as percentages."""
    return {
        "macro": {c: _rounded(summary.overall[c]) for c in summary.columns},
        "datasets": {
            d.dataset: {
                "relations": d.relations,
                "facts": d.facts,
                **_found(d.subjects_found),
                **{c: _rounded(d.columns[c]) for c in summary.columns},
            }
            for d in summary.datasets
        },
        "relations": {
            r.relation: {
                "dataset": r.dataset,
                "facts": r.facts,
                **_found(r.subjects_found),
                **{c: _rounded(r.columns[c]) for c in summary.columns},
            }
            for r in summary.relations
        },
        "settings": dict(settings),
    }


def _found(n: int | None) -> dict[str, int]:
    return {} if n is None else {"subjects_found": n}


def coverage_line(summary: Summary) -> str | None:
    """What share of the facts had their subject's article in the datastore: the kNN's part of P@k depends on it
    (the paper's datastore is all of Wikipedia). None when not known."""
    if summary.subjects is None:
        return None
    found, facts = summary.subjects
    share = 100.0 * found / facts if facts else 0.0
    return (f"subjects with an article in the datastore: {found} of {facts} facts that name one ({share:.1f}%); "
            "for the others the retriever chose the articles")


def format_table(summary: Summary, *, title: str = "") -> str:
    """Plain-text table: one row per relation, then per dataset (macro) and overall, three columns x P@1/5/10."""
    head = f"{'relation':<18} {'dataset':<10} {'n':>5} | " + " | ".join(
        f"{('adaptive' if c == ADAPTIVE else c) + ' P@1/5/10':^22}" for c in summary.columns
    )
    rule = "-" * len(head)

    def row(name: str, ds: str, n: int, cols: Mapping[str, Precisions]) -> str:
        cells = " | ".join(
            f"{cols[c]['p@1']:6.1f} {cols[c]['p@5']:6.1f} {cols[c]['p@10']:6.1f}   " for c in summary.columns
        )
        return f"{name:<18} {ds:<10} {n:>5} | {cells}"

    lines = [title] if title else []
    lines += [head, rule]
    lines += [row(r.relation, r.dataset, r.facts, r.columns) for r in summary.relations]
    lines.append(rule)
    lines += [row(f"macro {d.dataset}", f"{d.relations} rel", d.facts, d.columns) for d in summary.datasets]
    lines.append(row("macro overall", f"{len(summary.relations)} rel", summary.facts, summary.overall))
    lines.append(row("micro overall", "queries", summary.facts, summary.micro))
    if (coverage := coverage_line(summary)) is not None:
        lines.append(coverage)
    return "\n".join(lines)
