"""The build loop: blocks of articles -> masked contexts -> parts cut by contexts -> embeddings -> shard files ->
manifest."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bertknn.builder.blocks import BlockPlan, check_slicing, iter_blocks, plan_blocks
from bertknn.builder.coding import Coder, open_coder
from bertknn.builder.corpus import CorpusStats, corpus_language, detect_format
from bertknn.builder.embed import ShardOptions, Work, embed_shards, embed_step
from bertknn.builder.out_dir import foreign_entries, shown
from bertknn.builder.progress import BuildProgress
from bertknn.builder.sentences import SentenceSplitter
from bertknn.builder.settings import BuildSettings
from bertknn.builder.targets import load_stopwords, stopwords_sha256
from bertknn.builder.wikitext import TEXT_RULES
from bertknn.builder.writer import finished_parts, remove_stale_temp, write_table
from bertknn.core import logs
from bertknn.core.calibration import measure_distance_scale
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import BuildError, BuildInterrupted, DatastoreError
from bertknn.core.format import (
    BUILD_STATE,
    MANIFEST,
    REDIRECTS,
    CodecInfo,
    Counts,
    LinkInfo,
    Manifest,
    ModelInfo,
    ShardInfo,
    SliceInfo,
    SourceInfo,
    atomic_write_json,
    read_manifest,
    sha256_file,
    write_manifest,
)
from bertknn.core.format.health import (
    dropped_in,
    dropped_warning,
    target_warning,
    vocabulary_warning,
    with_empty_warning,
    word_target_share,
)
from bertknn.core.languages import unknown_language
from bertknn.core.model_ref import local_model_path
from bertknn.core.onnx_cache import onnx_cache
from bertknn.core.runtime import cpu_quota_threads

logger = logging.getLogger(__name__)


def _build_state(
    settings: BuildSettings, encoder: MaskedLMEncoder, stop_hash: str, sources: list[SourceInfo], unit: str,
    language: str = "en", sentence_rule: str = "",
) -> dict:
    """What a resumed build must share with the build it resumes."""
    return {
        "corpus": [str(Path(p).resolve()) for p in settings.corpus],
        "corpus_sha256": [s.sha256 for s in sources],
        "model_sha256": encoder.weights_sha256,
        "dtype": str(encoder.dtype).removeprefix("torch."),
        "layer": encoder.layer,
        "max_seq_len": settings.max_seq_len,
        "articles_per_shard": settings.articles_per_shard,
        "limit_articles": settings.limit_articles,
        "min_sentence_chars": settings.min_sentence_chars,
        "stopwords_sha256": stop_hash,
        "num_shards": settings.num_shards,
        "shard_index": settings.shard_index,
        # only when not the default, so that a build started before this setting existed still resumes
        **({"targets": settings.targets} if settings.targets != "single-piece" else {}),
        # likewise only when kept (builds started before links existed had none)
        **({"links": True} if settings.links else {}),
        # the forward backend in use (a resumed build does not mix backends); likewise only when not eager
        **({"backend": encoder.backend} if encoder.backend != "eager" else {}),
        # the rules that turn wikitext into sentences: a build started under other rules is not resumed
        "text_rules": TEXT_RULES,
        # a splitter that changed within these rules (Thai: the CRF segmenter, not the Unicode rule); only then
        **({"sentences": sentence_rule} if sentence_rule.startswith("pythainlp") else {}),
        **({"language": language} if language != "en" else {}),
        "contexts_per_shard": settings.contexts_per_shard,
        "blocks": unit,
        # the codec asked for; only when not fp16 (builds started before codecs existed still resume)
        **({"codec": _codec_state(settings)} if settings.codec != "fp16" or settings.codec_from else {}),
    }


def _codec_state(settings: BuildSettings) -> dict:
    if settings.codec_from is not None:
        return {"from": str(Path(settings.codec_from).resolve())}
    spec = settings.codec_spec()
    return {
        "name": spec.name, "code_bytes": spec.code_bytes, "rotation": spec.rotation, "pca_dim": spec.pca_dim,
        "train_contexts": spec.train_contexts, "seed": spec.seed,
    }  # fmt: skip


def builder_encoder(settings: BuildSettings, encoder: MaskedLMEncoder | None = None) -> MaskedLMEncoder:
    """Torch on the threads the settings give (else as many as the CPU quota allows), and the build's model at its
    layer without the MLM head (a build stores embeddings only), unless the caller brings an encoder."""
    torch.set_num_threads(settings.threads or cpu_quota_threads())
    return encoder or MaskedLMEncoder.load(
        settings.model, layer=settings.layer, device=settings.device, dtype=settings.dtype,
        max_seq_len=settings.max_seq_len, mlm_head="ignored",
    )  # fmt: skip


def check_corpus_files(paths: list[Path]) -> None:
    """Every corpus file exists, has a known format and can be read: checked before the model loads, so a bad
    path fails in a second, not after minutes."""
    if not paths:
        raise BuildError("no corpus given: pass --corpus FILE (JSONL or MediaWiki XML dump), repeatable")
    for path in paths:
        if not Path(path).is_file():
            what = "not a regular file" if Path(path).exists() else "no such corpus file"
            raise BuildError(f"{path}: {what}")
        detect_format(Path(path))  # (and refuses a file of nothing but space)
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise BuildError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from exc


def build(settings: BuildSettings, encoder: MaskedLMEncoder | None = None) -> Manifest:
    """Build (or resume) a datastore as the settings say, and return its manifest: check the corpus and the output
    directory, load the model, check (or record) the build's settings, embed the shards, then write the article
    table, the indexes and the manifest."""
    check_corpus_files(settings.corpus)
    plan = plan_blocks(settings.corpus, settings.index, settings.multistream)
    check_slicing(plan, settings.limit_articles, settings.num_shards)
    out = Path(settings.out)
    _refuse_updated(out)
    refuse_foreign_out(out)
    language = corpus_language(settings.corpus, settings.language)
    splitter = SentenceSplitter(language)  # one whose splitter is not installed is refused before the model loads
    stopwords = load_stopwords(settings.stopwords, language)
    if (unknown := unknown_language(language, splitter.rule, stopwords)) is not None:
        logger.warning(unknown)
    out.mkdir(parents=True, exist_ok=True)
    encoder = builder_encoder(settings, encoder)
    state_path = out / BUILD_STATE
    previous = json.loads(state_path.read_text()) if state_path.is_file() else None
    _choose_backend(encoder, settings, previous)
    if settings.num_shards > 1 and settings.codec != "fp16" and settings.codec_from is None:
        raise BuildError(
            f"the slices of a sliced build must share one codec: train it first (`bert-knn "
            f"train-codec --corpus ... --model ... --codec {settings.codec} --out CODEC_DIR`), then give every slice "
            "--codec-from CODEC_DIR"
        )
    sources = [
        SourceInfo(path=Path(p).name, format=detect_format(Path(p)), sha256=sha256_file(Path(p))) for p in settings.corpus
    ]
    state = _build_state(settings, encoder, stopwords_sha256(stopwords), sources, plan.unit, language, splitter.rule)
    _check_state(out, state, previous)
    remove_stale_temp(out)
    coder = open_coder(out, settings.codec_spec(), encoder.hidden_size, settings.codec_from)
    run = _BuildRun(settings, out, plan, language)
    encode_seconds = run.embed(encoder, stopwords, coder)
    manifest = run.write_manifest(encoder, stopwords_sha256(stopwords), sources, coder)
    run.log_summary(encode_seconds)
    return manifest


def refuse_foreign_out(out: Path) -> None:
    """``--out`` must be new, empty, or a build of this tool (to resume or finish it): a directory of other files
    is refused before the model loads, so a build never mixes its files into someone else's."""
    if out.is_dir() and ((out / BUILD_STATE).is_file() or (out / MANIFEST).is_file()):
        return
    foreign = foreign_entries(out)
    if foreign:
        raise BuildError(
            f"--out {out} holds files that are not a datastore's ({shown(foreign)}); pass a new or empty directory "
            "(a build in progress there is resumed, a finished datastore left as it is)"
        )


def _refuse_updated(out: Path) -> None:
    """A datastore that `add` updated is not built into again: that would drop what was added."""
    updated = existing_manifest(out)
    if updated is not None and updated.updates:
        raise BuildError(
            f"{out} holds version {updated.version} of a datastore that `add` updated; building into it again would "
            "drop what was added. Use `bert-knn add` to update it, or another --out"
        )


def _choose_backend(encoder: MaskedLMEncoder, settings: BuildSettings, previous: dict | None) -> None:
    """The forward's backend: the one asked, and for ``auto`` the one a resumed build started with."""
    asked = settings.backend
    if asked == "auto" and previous is not None:
        asked = previous.get("backend", "eager")  # a resumed build keeps the forward it started with
    if asked != "eager":
        used = encoder.set_backend(asked, with_mlm=False, onnx_cache=onnx_cache(asked, settings.onnx_cache, encoder.device))
        logger.info("forward backend: %s (asked: %s)", used, settings.backend)


def _check_state(out: Path, state: dict, previous: dict | None) -> None:
    """A resumed build must have been started with the same settings; a new one records them."""
    if previous is None:
        atomic_write_json(out / BUILD_STATE, state)
    elif previous != state:
        diff = sorted(k for k in {*state, *previous} if previous.get(k) != state.get(k))
        raise BuildError(
            f"{out} holds a build made with other settings ({', '.join(diff)} differ); "
            "use another --out, or delete the directory to start over"
        )


class _BuildRun:
    """One run of `build` after its checks: the parts it finds finished (resume) or embeds, what it counted on the
    way, its progress line, and the manifest it writes at the end."""

    def __init__(self, settings: BuildSettings, out: Path, plan: BlockPlan, language: str = "en"):
        self.settings, self.out, self.plan = settings, out, plan
        self.language = language
        self.stats = CorpusStats(language=language)
        self.counts = Counts()
        self.infos: list[ShardInfo] = []
        self.new_contexts = 0
        self.warnings: list[str] = []
        self.vocabulary_said: str | None = None  # the early `vocabulary_warning`, once logged
        self.whole = settings.num_shards == 1  # False: this process builds one slice (shards j with j % n == i)
        self.t0 = time.perf_counter()
        stored = sum(Path(p).stat().st_size for p in settings.corpus)
        if plan.unit == "streams" and not self.whole:
            stored //= settings.num_shards  # a slice of a multistream dump reads about its share of the streams
        self.stored = stored
        self.progress = BuildProgress(
            total_articles=settings.limit_articles, stages=self.stats.times, workers=settings.workers,
            read_fraction=self.read_fraction,
        )  # fmt: skip

    def read_fraction(self) -> float | None:
        return min(1.0, sum(self.stats.read.values()) / self.stored) if self.stored else None

    def works(self) -> Iterator[Work]:
        """The blocks' articles still to embed: a finished part is kept (and counted), a finished block skipped."""
        s = self.settings
        blocks = iter_blocks(
            self.plan, s.articles_per_shard, self.stats, self.counts,
            num_slices=s.num_shards, slice_index=s.shard_index, limit_articles=s.limit_articles,
        )  # fmt: skip
        for block in blocks:
            done = finished_parts(self.out, block.index)
            self.infos.extend(done)
            self.progress.resumed(sum(i.articles for i in done), sum(i.rows for i in done))
            for info in done:
                logger.info("shard %s already complete, skipped (resume)", info.name.removeprefix("shard-"))
            if done and done[-1].last:
                continue
            skip = sum(i.articles for i in done)
            if done:
                logger.info("block %05d resumed after its %d finished parts", block.index, len(done))
            yield Work(block.index, len(done), block.articles[skip:])

    def prepared(self, articles: int, contexts: int) -> None:
        """A block prepared: counted, and `vocabulary_warning` said as soon as the words seen show it (before the
        forward of a whole corpus that the model's tokenizer barely knows)."""
        self.progress.prepared(articles, contexts)
        if self.vocabulary_said is None and (line := self.vocabulary_warning()) is not None:
            logger.warning("%s", line)
            self.vocabulary_said = line

    def vocabulary_warning(self) -> str | None:
        t = self.stats.times
        return vocabulary_warning(t.words, t.word_targets, self.settings.targets, self.language)

    def written(self, info: ShardInfo) -> None:
        self.infos.append(info)
        self.new_contexts += info.rows
        self.progress.shard_written(info.articles)

    def embed(self, encoder: MaskedLMEncoder, stopwords: frozenset[str], coder: Coder | None) -> float:
        """Embed what is left (`embed_shards`); the forward passes' seconds. Interrupted, it says what is kept."""
        s = self.settings
        step = embed_step(s.checkpoint_contexts, s.batch_size, encoder.device.type)
        options = ShardOptions(
            s.max_seq_len, stopwords, s.min_sentence_chars, s.targets, s.batch_size, s.workers,
            s.contexts_per_shard or None, s.links, step, s.batch_tokens or None, s.vocab_cache,
        )  # fmt: skip
        try:
            return embed_shards(
                self.out, self.works(), encoder, options, self.written, self.progress.embedded, self.stats.times,
                coder, on_prepared=self.prepared, on_carried=self.progress.carried,
            )  # fmt: skip
        except BuildInterrupted as exc:
            kept = sorted({i.key: i for i in self.infos}.values(), key=lambda i: i.key)
            aside = f"; {exc.carried:,} contexts of the articles cut short kept aside for it" if exc.carried else ""
            raise BuildInterrupted(
                f"stopped: {self.out} keeps {len(kept)} finished parts ({sum(i.rows for i in kept):,} contexts of "
                f"{sum(i.articles for i in kept):,} articles; {self.new_contexts:,} contexts of them from this run)"
                f"{aside}; at most {step:,} contexts of work in flight were lost"
            ) from None
        finally:
            self.progress.close()

    def write_manifest(
        self, encoder: MaskedLMEncoder, stop_hash: str, sources: list[SourceInfo], coder: Coder | None
    ) -> Manifest:
        """The article table, the distance scale, the indexes (a whole build) and the manifest, written."""
        s, infos, counts = self.settings, sorted(self.infos, key=lambda i: i.key), self.counts
        counts.articles = sum(i.articles for i in infos)
        counts.sentences = sum(i.sentences for i in infos)
        counts.contexts = sum(i.rows for i in infos)
        counts.skipped_pages = self.stats.skipped_pages
        counts.dropped_sentences = dropped_in(infos)
        atomic_write_json(self.out / REDIRECTS, dict(sorted(self.stats.redirects.items())))
        manifest = Manifest(
            model=ModelInfo(
                name=encoder.name, path=local_model_path(encoder.name), weights_sha256=encoder.weights_sha256,
                architecture=type(encoder.model).__name__, num_layers=encoder.num_layers,
                hidden_size=encoder.hidden_size, vocab_size=encoder.vocab_size, numerics=encoder.numerics,
            ),
            layer=encoder.layer, max_seq_len=s.max_seq_len, articles_per_shard=s.articles_per_shard,
            contexts_per_shard=s.contexts_per_shard or None, stopwords_sha256=stop_hash, counts=counts,
            sources=sources, shards=infos,
            slice=None if self.whole else SliceInfo(index=s.shard_index, count=s.num_shards, unit=self.plan.unit),
            targets=s.targets, codec=coder.info if coder is not None else None,
            links=LinkInfo() if s.links else None,  # (its counts come with the article table)
            language=self.language,
        )  # fmt: skip
        write_table(self.out, manifest, sorted(self.stats.redirects.items()))
        manifest.warnings = self._warnings(manifest)
        manifest.distance_scale = measure_distance_scale(self.out, manifest)
        if self.whole:
            manifest.indexes.update(build_indexes(self.out, s, manifest))
        manifest.datastore_id = manifest.compute_id()
        write_manifest(self.out, manifest)
        self.infos = infos
        self.warnings = manifest.warnings
        return manifest

    def _warnings(self, manifest: Manifest) -> list[str]:
        """A truncated dump; no context at all; few word answers among the contexts; few words kept as targets;
        most sentences dropped (`format.health`)."""
        found = [
            *self.stats.warnings,
            target_warning(word_target_share(self.out, manifest)),
            self.vocabulary_warning(),
            dropped_warning(manifest.counts.dropped_sentences, manifest.counts.sentences),
        ]
        return with_empty_warning([w for w in found if w], manifest.counts)

    def log_summary(self, encode_seconds: float) -> None:
        elapsed = time.perf_counter() - self.t0
        disk = sum(f.bytes for i in self.infos for f in i.files.values())
        contexts, new = self.counts.contexts, self.new_contexts
        summary = {
            "articles": self.counts.articles,
            "sentences": self.counts.sentences,
            "contexts": contexts,
            "new_contexts": new,
            "bytes_per_context": round(disk / max(1, contexts), 1),
            "contexts_per_s": round(new / elapsed, 1) if new else None,
            "encode_contexts_per_s": round(new / encode_seconds, 1) if encode_seconds else None,
            "seconds": round(elapsed, 2),
            **self.stats.times.summary(self.settings.workers),
        }
        logger.info(logs.summary("build finished", summary))
        for line in self.warnings:
            if line not in self.stats.warnings and line != self.vocabulary_said:  # (said when met, the same)
                logger.warning("%s", line)


def train_codec_only(settings: BuildSettings, encoder: MaskedLMEncoder | None = None) -> CodecInfo:
    """``train-codec``: the codec a build with these settings would train, from the corpus's first contexts,
    written to ``settings.out`` (codec.faiss and codec.json) for ``build --codec-from`` (every slice of a sliced
    build). No shard is written; slicing flags are ignored (the codec is the whole corpus's)."""
    check_corpus_files(settings.corpus)
    spec = settings.codec_spec()
    if not spec.trained:
        raise BuildError("train-codec trains a codec: give --codec int8 or --codec pq")
    plan = plan_blocks(settings.corpus, settings.index, settings.multistream)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    encoder = builder_encoder(settings, encoder)
    coder = open_coder(out, spec, encoder.hidden_size)
    assert coder is not None
    if coder.ready:
        assert coder.info is not None
        return coder.info
    language = corpus_language(settings.corpus, settings.language)
    stopwords = load_stopwords(settings.stopwords, language)
    stats = CorpusStats(language=language)
    blocks = iter_blocks(plan, settings.articles_per_shard, stats, Counts(), limit_articles=settings.limit_articles)
    options = ShardOptions(
        settings.max_seq_len, stopwords, settings.min_sentence_chars, settings.targets, settings.batch_size,
        settings.workers, settings.contexts_per_shard or None, settings.links,
        embed_step(settings.checkpoint_contexts, settings.batch_size, encoder.device.type), settings.batch_tokens or None,
        settings.vocab_cache,
    )
    works = (Work(b.index, 0, b.articles) for b in blocks)
    embed_shards(out, works, encoder, options, lambda info: None, coder=coder, train_only=True)
    assert coder.info is not None
    return coder.info


def build_indexes(out: Path, settings: BuildSettings, manifest: Manifest) -> dict[str, str]:
    """Sparse article indexes (and optionally IVF-PQ) over the finished shards."""
    indexes: dict[str, str] = {}
    if settings.sparse_indexes:
        from bertknn.builder.sparse_index import build_sparse_indexes

        stopwords = load_stopwords(settings.stopwords, manifest.language)
        indexes.update(build_sparse_indexes(out, manifest, bm25=settings.bm25, stopwords=stopwords))
    if settings.ivfpq:
        from bertknn.builder.ivfpq import build_ivfpq

        indexes.update(build_ivfpq(out, manifest))
    return indexes


def existing_manifest(out: Path) -> Manifest | None:
    try:
        return read_manifest(out)
    except DatastoreError:
        return None
