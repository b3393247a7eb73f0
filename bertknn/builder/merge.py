"""Join the slices of a ``--shard-index i --num-shards n`` build into one datastore (``merge`` subcommand).

Slice ``i`` holds the blocks ``j`` with ``j % n == i``, their parts already named ``shard-{j:05d}[.{part:03d}]``,
so merging is checking that the slices belong together, linking (or copying) their shard directories side by
side, and writing the indexes and the manifest of the whole. The result equals a single-worker build byte for byte in
its shard files and its manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from bertknn.builder.out_dir import foreign_entries, shown
from bertknn.builder.writer import link_or_copy
from bertknn.core import logs
from bertknn.core.calibration import measure_distance_scale
from bertknn.core.errors import BuildError, MergeError
from bertknn.core.format import (
    ARTICLE_TABLE,
    FORMAT_VERSION,
    INDEX_DIR,
    MANIFEST,
    REDIRECTS,
    SHARD_MARKER,
    SHARDS_DIR,
    Counts,
    LinkInfo,
    Manifest,
    ShardInfo,
    atomic_write_json,
    check_shard_files,
    read_manifest,
    read_shard_info,
    sha256_file,
    shard_file_names,
    validate_parts,
    write_manifest,
)
from bertknn.core.format.health import dropped_in, with_empty_warning

logger = logging.getLogger(__name__)

# build.json keys (see build._build_state) that every slice of one build shares; the others
# (absolute corpus paths, the slice index) legitimately differ between workers.
_SHARED_BUILD_STATE = (
    "corpus_sha256",
    "model_sha256",
    "dtype",
    "layer",
    "max_seq_len",
    "articles_per_shard",
    "limit_articles",
    "min_sentence_chars",
    "stopwords_sha256",
    "num_shards",
    "targets",
    "links",
    "contexts_per_shard",
    "blocks",
    "text_rules",
)


def merge_slices(
    slices: list[Path],
    out: Path,
    *,
    ivfpq: bool = False,
    sparse_indexes: bool = True,
    verify: bool = True,
) -> Manifest:
    """Merge slice datastores into ``out`` and return the merged manifest.

    Args:
        slices: the output directories of ``build --shard-index i --num-shards n``, one per ``i``, any order.
        out: the merged datastore directory; must not hold a finished datastore. An interrupted merge into
            the same directory resumes (shards already linked or copied intact are kept).
        ivfpq: also build the whole-datastore IVF-PQ index.
        sparse_indexes: build the BM25 and TF-IDF article indexes (as ``build`` does by default).
        verify: check every shard file's sha256 before taking it (otherwise sizes only).
    """
    slices = [Path(s) for s in slices]
    out = Path(out)
    if not slices:
        raise MergeError("no slices given: pass the output directory of every `build --shard-index i` worker")
    manifests = [read_manifest(s) for s in slices]
    by_index = _check_slices(slices, manifests)
    resolved_out = out.resolve()
    for s in slices:
        if s.resolve() == resolved_out:
            raise MergeError(f"--out {out} is one of the slices; merge into a new directory")
    if (out / MANIFEST).exists():
        raise MergeError(f"{out / MANIFEST}: {out} already holds a finished datastore; use another --out or delete it")
    _refuse_foreign(out, by_index[0][1])
    # every check that reads only the slices comes before the first write into ``out``
    shards = _all_shards(by_index)
    redirects = _merge_redirects(slices)
    first_dir, codec = by_index[0][0], by_index[0][1].codec
    if codec is not None:
        _check_codec_file(first_dir / codec.file, codec.sha256)
    linked, copied = _take_shards(shards, out, verify=verify)
    logger.info("merge: %d shards from %d slices (%d files linked, %d copied)", len(shards), len(slices), linked, copied)
    if codec is not None:
        _take_codec(first_dir / codec.file, out / codec.file)
    atomic_write_json(out / REDIRECTS, redirects)
    manifest = _merged_manifest(by_index, manifests, [info for _, info in shards])
    _finish(out, manifest, redirects, sparse_indexes=sparse_indexes, ivfpq=ivfpq)
    logger.info(logs.summary("merge finished", {"datastore": str(out), "id": manifest.datastore_id,
                                                "shards": len(shards), **manifest.counts.model_dump()}))
    return manifest


def _all_shards(by_index: list[tuple[Path, Manifest]]) -> list[tuple[Path, ShardInfo]]:
    """Every slice's shards (their directory, their info), in the merged order; MergeError unless they form
    shard-00000.. without a gap or a duplicate, each with its files."""
    shards: list[tuple[Path, ShardInfo]] = []
    for slice_dir, m in by_index:
        shards.extend((slice_dir / SHARDS_DIR / info.name, info) for info in m.shards)
    shards.sort(key=lambda item: item[1].key)
    indexes = sorted({info.index for _, info in shards})
    if indexes != list(range(len(indexes))):
        missing = sorted(set(range(max(indexes, default=-1) + 1)) - set(indexes))
        dupes = sorted(j for j, k in Counter(indexes).items() if k > 1)
        raise MergeError(
            f"the slices' shards do not form shard-00000..shard-{len(indexes) - 1:05d}: "
            f"missing {missing[:10]}, duplicated {dupes[:10]}; rebuild the slices that own the missing shards "
            "(shard j belongs to slice j % n) with the same arguments"
        )
    problems = validate_parts(Path("<merged>"), [info for _, info in shards])
    if problems:
        raise MergeError(f"{problems[0]}; rebuild that slice with the same arguments (it resumes)")
    return shards


def _refuse_foreign(out: Path, first: Manifest) -> None:
    """``--out`` must be new, empty, or an interrupted merge (which resumes): its files are all a merge's own."""
    own = {SHARDS_DIR, REDIRECTS, ARTICLE_TABLE, INDEX_DIR, *([first.codec.file] if first.codec is not None else [])}
    try:
        foreign = foreign_entries(out, own)
    except BuildError as exc:
        raise MergeError(str(exc)) from None
    if foreign:
        raise MergeError(
            f"--out {out} holds files that are not a datastore's ({shown(foreign)}); merge into a new or empty "
            "directory (an interrupted merge there is resumed)"
        )


def _take_shards(shards: list[tuple[Path, ShardInfo]], out: Path, *, verify: bool) -> tuple[int, int]:
    """The shards into ``out/shards`` (hard links, else copies; those already there intact are kept), and the
    directory synced so that the renames survive a crash before the manifest is written; the files linked and
    copied."""
    out.mkdir(parents=True, exist_ok=True)
    (out / SHARDS_DIR).mkdir(exist_ok=True)
    for p in (out / SHARDS_DIR).glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    linked = copied = 0
    for src, info in shards:
        n_linked, n_copied = _take_shard(src, out / SHARDS_DIR / info.name, info, verify=verify)
        linked += n_linked
        copied += n_copied
    dir_fd = os.open(out / SHARDS_DIR, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return linked, copied


def _merged_manifest(
    by_index: list[tuple[Path, Manifest]], manifests: list[Manifest], shards: list[ShardInfo]
) -> Manifest:
    """The merged datastore's manifest before its table and indexes: the first slice's settings, every slice's
    counts."""
    first = by_index[0][1]
    # By articles, every slice reads the whole corpus, so its corpus-wide counts are the same in each slice; by
    # streams, each slice counts what it read.
    own = [m for _, m in by_index] if first.slice is not None and first.slice.unit == "streams" else [first]
    counts = Counts(
        articles=sum(m.counts.articles for m in manifests),
        sentences=sum(m.counts.sentences for m in manifests),
        contexts=sum(m.counts.contexts for m in manifests),
        skipped_duplicate_titles=sum(m.counts.skipped_duplicate_titles for m in own),
        skipped_pages=sum(m.counts.skipped_pages for m in own),
        dropped_sentences=dropped_in(shards),
    )
    return Manifest(
        model=first.model, layer=first.layer, dtype=first.dtype, max_seq_len=first.max_seq_len,
        articles_per_shard=first.articles_per_shard, contexts_per_shard=first.contexts_per_shard,
        stopwords_sha256=first.stopwords_sha256, counts=counts, sources=first.sources, shards=shards, slice=None,
        targets=first.targets, codec=first.codec,
        links=None if first.links is None else LinkInfo(),  # (counted again over all slices with the table)
        language=first.language,
        warnings=with_empty_warning(list(dict.fromkeys(w for m in manifests for w in m.warnings)), counts),
    )  # fmt: skip


def _finish(out: Path, manifest: Manifest, redirects: dict[str, str], *, sparse_indexes: bool, ivfpq: bool) -> None:
    """The article table, the distance scale and the indexes of the merged datastore, then its manifest."""
    from bertknn.builder.build import build_indexes
    from bertknn.builder.settings import BuildSettings
    from bertknn.builder.writer import write_table

    write_table(out, manifest, redirects.items())
    manifest.distance_scale = measure_distance_scale(out, manifest)
    # model_construct: only the two index switches matter here, and a merge pod's environment may carry
    # a worker's BERTKNN_BUILD_* variables that must not be validated or applied.
    index_settings = BuildSettings.model_construct(sparse_indexes=sparse_indexes, ivfpq=ivfpq)
    manifest.indexes.update(build_indexes(out, index_settings, manifest))
    manifest.datastore_id = manifest.compute_id()
    write_manifest(out, manifest)


def _check_codec_file(src: Path, sha256: str) -> None:
    """The first slice's codec file is there and has its manifest's checksum."""
    if not src.is_file():
        raise MergeError(f"{src}: missing (the codec the slice's manifest names); rebuild that slice")
    if sha256_file(src) != sha256:
        raise MergeError(f"{src}: sha256 differs from the slice's manifest (corrupted); rebuild that slice")


def _take_codec(src: Path, dst: Path) -> None:
    """The slices' codec into the merged datastore: a hard link, else a copy."""
    if dst.exists():
        return
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    link_or_copy(src, tmp)
    tmp.replace(dst)


# what every slice of one build has the same (the first slice's is the reference)
_SAME: dict[str, Callable[[Manifest], object]] = {
    "model weights (sha256)": lambda m: m.model.weights_sha256,
    "layer": lambda m: m.layer,
    "dtype": lambda m: m.dtype,
    "max_seq_len": lambda m: m.max_seq_len,
    "articles_per_shard": lambda m: m.articles_per_shard,
    "contexts_per_shard": lambda m: m.contexts_per_shard,
    "blocks cut by": lambda m: m.slice.unit if m.slice else None,
    "stopwords (sha256)": lambda m: m.stopwords_sha256,
    "targets": lambda m: m.targets,
    "language": lambda m: m.language,
    "links": lambda m: m.links is not None,
    "num_shards": lambda m: m.slice.count if m.slice else None,
    "corpus sources": lambda m: [s.model_dump() for s in m.sources],
    # the slices share one trained codec (`train-codec`, then `build --codec-from`)
    "codec": lambda m: m.codec.sha256 if m.codec else "fp16",
}
# slices cut by articles each skipped the same pages (every slice reads the whole corpus)
_SAME_BY_ARTICLES: dict[str, Callable[[Manifest], object]] = {
    "skipped duplicate titles": lambda m: m.counts.skipped_duplicate_titles,
    "skipped pages": lambda m: m.counts.skipped_pages,
}


def _check_each_is_a_slice(slices: list[Path], manifests: list[Manifest]) -> None:
    for path, m in zip(slices, manifests, strict=True):
        if m.format_version != FORMAT_VERSION:
            raise MergeError(f"{path / MANIFEST}: format version {m.format_version}, this code merges {FORMAT_VERSION}")
        if m.slice is None:
            raise MergeError(
                f"{path}: not a slice (built without --num-shards); only the outputs of "
                "`build --shard-index i --num-shards n` are merged"
            )


def _check_one_build(slices: list[Path], manifests: list[Manifest]) -> None:
    """Every slice has the first one's settings, model and corpus."""
    ref_path, ref = slices[0], manifests[0]
    fields = dict(_SAME)
    if ref.slice is not None and ref.slice.unit == "articles":
        fields.update(_SAME_BY_ARTICLES)
    for path, m in zip(slices[1:], manifests[1:], strict=True):
        for name, get in fields.items():
            if get(m) != get(ref):
                raise MergeError(
                    f"{path}: {name} is {get(m)!r}, but {ref_path} has {get(ref)!r}; "
                    "the slices come from different builds (rebuild them with the same arguments)"
                )


def _check_every_index_once(slices: list[Path], manifests: list[Manifest]) -> None:
    """Each slice index once, every index present, and each slice's shards its own."""
    n = manifests[0].slice.count if manifests[0].slice else 0
    seen: dict[int, Path] = {}
    for path, m in zip(slices, manifests, strict=True):
        assert m.slice is not None
        if m.slice.index in seen:
            raise MergeError(f"{path} and {seen[m.slice.index]} are both slice {m.slice.index} of {n}; give each once")
        seen[m.slice.index] = path
        for info in m.shards:
            if info.index % n != m.slice.index:
                raise MergeError(
                    f"{path}: holds {info.name}, which belongs to slice {info.index % n} of {n}, not {m.slice.index}"
                )
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        raise MergeError(
            f"slices {missing} of {n} are missing; build them with --shard-index K --num-shards {n} and pass every "
            "slice to merge"
        )


def _check_slices(slices: list[Path], manifests: list[Manifest]) -> list[tuple[Path, Manifest]]:
    """The slices of one build, ordered by slice index; MergeError names the first mismatch."""
    _check_each_is_a_slice(slices, manifests)
    _check_one_build(slices, manifests)
    _check_build_states(slices)
    _check_every_index_once(slices, manifests)
    return sorted(zip(slices, manifests, strict=True), key=lambda item: item[1].slice.index if item[1].slice else 0)

def _check_build_states(slices: list[Path]) -> None:
    """Settings that leave no trace in the manifest (article limit, sentence filter) must agree too."""
    states = []
    for path in slices:
        state_path = path / "build.json"
        if not state_path.is_file():
            return  # a slice copied without its build state: the manifest checks above are all we have
        states.append((path, json.loads(state_path.read_text(encoding="utf-8"))))
    ref_path, ref = states[0]
    for path, state in states[1:]:
        diff = [k for k in _SHARED_BUILD_STATE if state.get(k) != ref.get(k)]
        if diff:
            raise MergeError(
                f"{path}: built with other settings than {ref_path} ({', '.join(diff)} differ); "
                "rebuild the slices with the same arguments"
            )


def _take_shard(src: Path, dst: Path, info: ShardInfo, *, verify: bool) -> tuple[int, int]:
    """Hard-link (same filesystem) or copy one finished shard into place, all or nothing; (linked, copied)."""
    on_disk = read_shard_info(src)
    if on_disk is None:
        raise MergeError(f"{src / SHARD_MARKER}: missing or unreadable; rebuild this slice (same arguments resume it)")
    if on_disk != info:
        raise MergeError(f"{src / SHARD_MARKER}: differs from its slice manifest's entry; rebuild this slice")
    if dst.exists():
        if read_shard_info(dst) == info and check_shard_files(dst, info, hashes=verify) is None:
            return 0, 0  # taken by an earlier, interrupted merge
        shutil.rmtree(dst)
    problem = check_shard_files(src, info, hashes=verify)
    if problem:
        raise MergeError(f"{problem}; rebuild this slice (re-running its build command replaces the shard)")
    tmp = dst.with_name(f".tmp-{dst.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    linked = copied = 0
    for name in (*shard_file_names(info), SHARD_MARKER):
        if link_or_copy(src / name, tmp / name):
            linked += 1
        else:
            copied += 1
    os.replace(tmp, dst)
    return linked, copied


def _merge_redirects(slices: list[Path]) -> dict[str, str]:
    """Union of the slices' redirects (each slice reads the whole corpus, so they normally agree)."""
    merged: dict[str, str] = {}
    for path in slices:
        redirects_path = path / REDIRECTS
        if not redirects_path.is_file():
            continue
        for source, target in json.loads(redirects_path.read_text(encoding="utf-8")).items():
            previous = merged.setdefault(source, target)
            if previous != target:
                raise MergeError(f"{redirects_path}: redirect {source!r} -> {target!r}, another slice says {previous!r}")
    return dict(sorted(merged.items()))
