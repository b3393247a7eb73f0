"""The article table's two candidate forms, measured on the same titles: SQLite (the choice) and memory-mapped sorted
arrays (64-bit title hashes searched with ``np.searchsorted``, titles in a UTF-8 blob to confirm a hit).

    python -m bench.article_table [--articles 1000000]

Both are written to a temporary directory, then opened cold in this process and asked the same lookups in
alternating blocks: a title (present or not), a folded title (its candidates), and row -> title. Printed: write
time, open time, disk, and microseconds per lookup; ``bench/results/article_table.json`` keeps them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.common import RESULTS, machine
from bertknn.core.format.table import ArticleTable, write_article_table
from bertknn.core.titles import fold_title


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


class SortedArrays:
    """The alternative: title hash -> entry by binary search over memory-mapped arrays."""

    @staticmethod
    def write(directory: Path, titles: list[str], rows: np.ndarray) -> None:
        hashes = np.fromiter((_h(t) for t in titles), dtype=np.int64, count=len(titles))
        order = np.argsort(hashes, kind="stable")
        np.save(directory / "hash.npy", hashes[order])
        np.save(directory / "order.npy", order.astype(np.int64))
        folded = np.fromiter((_h(fold_title(t)) for t in titles), dtype=np.int64, count=len(titles))
        forder = np.argsort(folded, kind="stable")
        np.save(directory / "fold_hash.npy", folded[forder])
        np.save(directory / "fold_order.npy", forder.astype(np.int64))
        blob = [t.encode("utf-8") for t in titles]
        offsets = np.zeros(len(blob) + 1, np.int64)
        np.cumsum([len(b) for b in blob], out=offsets[1:])
        (directory / "titles.bin").write_bytes(b"".join(blob))
        np.save(directory / "title_offsets.npy", offsets)
        np.save(directory / "entries.npy", rows)  # [n, 5]: shard, row_start, row_end, sent_start, sent_end

    def __init__(self, directory: Path):
        def m(name: str) -> np.ndarray:
            return np.load(directory / name, mmap_mode="r")

        self.hash, self.order, self.fold_hash, self.fold_order = (m("hash.npy"), m("order.npy"), m("fold_hash.npy"),
                                                                  m("fold_order.npy"))  # fmt: skip
        self.offsets, self.entries = m("title_offsets.npy"), m("entries.npy")
        self.blob = np.memmap(directory / "titles.bin", dtype=np.uint8, mode="r")

    def title(self, i: int) -> str:
        return bytes(self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])]).decode("utf-8")

    def get(self, title: str) -> tuple | None:
        h = _h(title)
        i = int(np.searchsorted(self.hash, h))
        while i < len(self.hash) and self.hash[i] == h:
            j = int(self.order[i])
            if self.title(j) == title:
                return tuple(self.entries[j].tolist())
            i += 1
        return None

    def folded(self, key: str) -> list[str]:
        h = _h(key)
        a, b = int(np.searchsorted(self.fold_hash, h)), int(np.searchsorted(self.fold_hash, h, side="right"))
        return [t for t in (self.title(int(self.fold_order[i])) for i in range(a, b)) if fold_title(t) == key]


PER_SHARD = 5000


def _write_both(tmp: Path, titles: list[str], entries: np.ndarray, result: dict[str, dict[str, float]]) -> None:
    """The same articles as the SQLite table and as sorted arrays: each one's write time and size on disk."""
    t = time.perf_counter()
    shards = []
    for s in range(0, len(titles), PER_SHARD):
        shards.append((s // PER_SHARD, [{"title": titles[i], "id": str(i), "source": "x",
                                         "row_start": int(entries[i, 1]), "row_end": int(entries[i, 2]),
                                         "sent_start": int(entries[i, 3]), "sent_end": int(entries[i, 4])}
                                        for i in range(s, min(s + PER_SHARD, len(titles)))]))  # fmt: skip
    write_article_table(tmp / "t.sqlite", shards, [], content_id="bench")
    result["sqlite"]["write_s"] = time.perf_counter() - t
    arrays_dir = tmp / "arrays"
    arrays_dir.mkdir()
    t = time.perf_counter()
    SortedArrays.write(arrays_dir, titles, entries)
    result["sorted_arrays"]["write_s"] = time.perf_counter() - t
    result["sqlite"]["disk_mb"] = (tmp / "t.sqlite").stat().st_size / 1e6
    result["sorted_arrays"]["disk_mb"] = sum(f.stat().st_size for f in arrays_dir.iterdir()) / 1e6


def _time_lookups(tmp: Path, asked: list[str], result: dict[str, dict[str, float]]) -> None:
    """Each form's open time, then its title and folded-title look-ups (best of two alternating blocks each),
    and a check that both forms find the same articles."""
    t = time.perf_counter()
    table = ArticleTable(tmp / "t.sqlite")
    result["sqlite"]["open_ms"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    arrays = SortedArrays(tmp / "arrays")
    result["sorted_arrays"]["open_ms"] = (time.perf_counter() - t) * 1000
    folded = [fold_title(q) for q in asked]
    ops: dict[str, dict[str, Callable[[str, str], object]]] = {
        "sqlite": {"title_us": lambda q, f: table.get(q), "folded_us": lambda q, f: table.folded(f)},
        "sorted_arrays": {"title_us": lambda q, f: arrays.get(q), "folded_us": lambda q, f: arrays.folded(f)},
    }
    for round_ in range(4):  # alternating blocks: drift falls on both
        for name in ("sqlite", "sorted_arrays") if round_ % 2 == 0 else ("sorted_arrays", "sqlite"):
            for op, fn in ops[name].items():
                t = time.perf_counter()
                for q, f in zip(asked, folded, strict=True):
                    fn(q, f)
                us = (time.perf_counter() - t) / len(asked) * 1e6
                result[name][op] = min(result[name].get(op, float("inf")), us)
    for q in asked[:200]:  # both agree
        assert (table.get(q) is None) == (arrays.get(q) is None)
    table.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--articles", type=int, default=1_000_000)
    p.add_argument("--lookups", type=int, default=20_000)
    p.add_argument("--out", type=Path, default=RESULTS / "article_table.json")
    args = p.parse_args(argv)
    rng = random.Random(0)
    titles = [f"Title {i} {rng.choice(['Émile', 'Paris', 'river', 'band'])}" for i in range(args.articles)]
    entries = np.array([(i // PER_SHARD, (i % PER_SHARD) * 10, (i % PER_SHARD) * 10 + 10, i % PER_SHARD,
                         i % PER_SHARD + 1) for i in range(len(titles))], dtype=np.int64)  # fmt: skip
    result: dict[str, dict[str, float]] = {"sqlite": {}, "sorted_arrays": {}}
    with tempfile.TemporaryDirectory(prefix="bench-table-") as tmp:
        _write_both(Path(tmp), titles, entries, result)
        asked = [titles[rng.randrange(len(titles))] if k % 4 else f"Missing {k}" for k in range(args.lookups)]
        _time_lookups(Path(tmp), asked, result)
    print(f"{'form':>14} {'write s':>8} {'open ms':>8} {'disk MB':>8} {'title us':>9} {'folded us':>10}")
    for name, r in result.items():
        print(f"{name:>14} {r['write_s']:>8.1f} {r['open_ms']:>8.2f} {r['disk_mb']:>8.1f} {r['title_us']:>9.1f} "
              f"{r['folded_us']:>10.1f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"articles": args.articles, "machine": machine(), "result": result}, indent=1))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
