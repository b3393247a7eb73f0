"""Builder throughput: contexts/s of the whole build vs the bare model forward on the same batches.

    python -m bench.builder            # proxy model, first 200 vital articles, CPU, 2 runs
    python -m bench.builder --model runs/bert-base-shaped --articles 30 --runs 1 --codec fp16,int8,pq
                                       # bytes per context of each codec with bert-base-uncased's shape

The build runs in this process with the real pipeline (corpus reading, sentence splitting, target selection in a
worker process, embedding, shard writing with checksums, manifest). The bare forward then re-runs only
``MaskedLMEncoder.encode`` over exactly the batches the build embedded (the encoder handed to ``build`` records
them), with nothing else running. Their ratio is the share of the model's speed the pipeline keeps.
Model loading and building the compiled forward (``--backend onnx``: an export, about 5 s for bert-base, printed
apart) are outside both timings; the sparse article indexes are not built (a separate stage).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import PROXY_MODEL, RESULTS, SHARED, machine, write_json
from bertknn.builder.build import build
from bertknn.builder.settings import BuildSettings
from bertknn.core.encoder import EncoderOutput, MaskedLMEncoder
from bertknn.core.format import read_manifest
from bertknn.core.inputs import MaskedInput
from bertknn.core.runtime import cpu_quota_threads

VITAL = SHARED / "data" / "wiki" / "vital_articles.jsonl"


class RecordingEncoder:
    """Delegates to the real encoder and keeps every batch it is asked to embed (and the time spent)."""

    def __init__(self, inner: MaskedLMEncoder):
        self._inner = inner
        self.batches: list[Sequence[MaskedInput]] = []
        self.seconds = 0.0
        # from the first batch asked to the last batch's rows taken: the build without its start (workers
        # spawned, the first shard prepared) and its end (the last shard written, the manifest)
        self.first_start: float | None = None
        self.last_end = 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def encode(self, items: Sequence[MaskedInput], *, with_mlm: bool = False) -> EncoderOutput:
        self.batches.append(items)
        t = time.perf_counter()
        out = self._inner.encode(items, with_mlm=with_mlm)
        self.seconds += time.perf_counter() - t
        return out

    def encode_async(self, items: Sequence[MaskedInput]) -> Callable[[], np.ndarray]:
        """The builder's call: the time until the batch's rows are taken counts (on a GPU the forward runs
        between the start and that)."""
        self.batches.append(items)
        t = time.perf_counter()
        self.first_start = t if self.first_start is None else self.first_start
        result = self._inner.encode_async(items)
        self.seconds += time.perf_counter() - t

        def timed() -> np.ndarray:
            t = time.perf_counter()
            rows = result()
            self.last_end = time.perf_counter()
            self.seconds += self.last_end - t
            return rows

        return timed


class _BuildSummary(logging.Handler):
    """Catches the build's closing summary line (JSON), which holds the per-stage accounting."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.stages: dict = {}
        self.bound = ""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("build finished: "):
            data = json.loads(msg.removeprefix("build finished: "))
            self.stages, self.bound = data.get("stages", {}), data.get("bound", "")


def one_run(
    encoder: MaskedLMEncoder, corpus: Path, args: argparse.Namespace, backend: str, codec: str = "fp16",
    batch_tokens: int = 4096,
) -> dict[str, object]:
    """One timed build into a temporary folder, then the bare forward over exactly its batches: the run's record."""
    out = Path(tempfile.mkdtemp(prefix="bench-builder-"))
    try:
        recorder = RecordingEncoder(encoder)
        # Like loading the model, building the compiled forward is outside the timing: it happens once per
        # build (an ONNX export of bert-base takes about 5 s), whatever the corpus' size. `build` then keeps it.
        t = time.perf_counter()
        encoder.set_backend(backend, with_mlm=False)
        setup_s = time.perf_counter() - t
        build_s, summary = _timed_build(_settings(corpus, out, args, backend, codec, batch_tokens), recorder)
        forward_s = _bare_forward(encoder, recorder.batches)
        record = {"backend": encoder.backend,
                  "forward": f"cut at layer {encoder.layer} ({encoder.eager.cut})" if encoder.eager.truncated else "full",
                  "batch_tokens": batch_tokens, **_padding(recorder.batches)}  # fmt: skip
        return record | _rates(out, recorder, build_s, forward_s, setup_s) | {
            # per stage: seconds, items, items/s per process, and the stage that bounds the build
            "stages": summary.stages, "bound": summary.bound,
        }  # fmt: skip
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _settings(
    corpus: Path, out: Path, args: argparse.Namespace, backend: str, codec: str, batch_tokens: int
) -> BuildSettings:
    return BuildSettings(
        corpus=[corpus], model=str(args.model), out=out, device=args.device, batch_size=args.batch_size,
        batch_tokens=batch_tokens, max_seq_len=args.max_seq_len, articles_per_shard=args.articles_per_shard,
        checkpoint_contexts=args.checkpoint_contexts, workers=args.workers, sparse_indexes=False, backend=backend,
        codec=codec, code_bytes=args.code_bytes,
    )  # fmt: skip


def _timed_build(settings: BuildSettings, recorder: RecordingEncoder) -> tuple[float, _BuildSummary]:
    """The build's seconds, and its closing summary (caught from its log, which goes nowhere else meanwhile)."""
    summary = _BuildSummary()
    log = logging.getLogger("bertknn.builder.build")
    level, propagate = log.level, log.propagate
    log.addHandler(summary)
    log.setLevel(logging.INFO)  # the summary is an INFO line; it goes to this handler only
    log.propagate = False
    t = time.perf_counter()
    try:
        build(settings, encoder=recorder)  # type: ignore[arg-type]
    finally:
        log.removeHandler(summary)
        log.setLevel(level)
        log.propagate = propagate
    return time.perf_counter() - t, summary


def _bare_forward(encoder: MaskedLMEncoder, batches: list[Sequence[MaskedInput]]) -> float:
    """Seconds of the bare forward: the build's batches, in the same order, nothing else running."""
    forward_s = 0.0
    for batch in batches:
        t = time.perf_counter()
        encoder.encode(batch)
        forward_s += time.perf_counter() - t
    return forward_s


def _padding(batches: list[Sequence[MaskedInput]]) -> dict[str, object]:
    tokens = sum(len(x.input_ids) for b in batches for x in b)
    padded = sum(len(b) * max(len(x.input_ids) for x in b) for b in batches)
    return {"padding_fraction": round(1 - tokens / padded, 4)}


def _rates(out: Path, recorder: RecordingEncoder, build_s: float, forward_s: float, setup_s: float) -> dict[str, object]:
    """The run's counts, rates and bytes per context, from the manifest and the files the build wrote."""
    manifest = read_manifest(out)
    contexts = manifest.counts.contexts
    assert sum(len(b) for b in recorder.batches) == contexts
    shard_bytes = sum(f.bytes for s in manifest.shards for f in s.files.values())
    text_bytes = sum(f.bytes for s in manifest.shards for n, f in s.files.items() if n == "sentences.txt")
    codec_file = out / manifest.codec.file if manifest.codec else None
    all_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "codec": manifest.codec.factory if manifest.codec else "fp16",
        "articles": manifest.counts.articles,
        "sentences": manifest.counts.sentences,
        "contexts": contexts,
        "shards": len(manifest.shards),
        "batches": len(recorder.batches),
        "backend_setup_s": round(setup_s, 2),
        "build_s": round(build_s, 2),
        "build_ctx_per_s": round(contexts / build_s, 1),
        "forward_in_build_ctx_per_s": round(contexts / recorder.seconds, 1),
        # the rate between the first batch asked and the last one taken: what a long build runs at
        "embed_span_ctx_per_s": round(contexts / (recorder.last_end - recorder.first_start), 1)
        if recorder.first_start is not None and recorder.last_end > recorder.first_start else None,
        "bare_forward_s": round(forward_s, 2),
        "bare_forward_ctx_per_s": round(contexts / forward_s, 1),
        "build_over_forward": round((contexts / build_s) / (contexts / forward_s), 3),
        "bytes_per_context_shards": round(shard_bytes / contexts, 1),
        # what the budget counts: vectors or codes, labels, references (sentences text apart)
        "bytes_per_context_without_text": round((shard_bytes - text_bytes) / contexts, 1),
        "text_bytes_per_context": round(text_bytes / contexts, 1),
        "codec_file_bytes": codec_file.stat().st_size if codec_file else 0,
        "bytes_per_context_dir": round(all_bytes / contexts, 1),
        "vector_bytes_per_context": manifest.model.hidden_size * 2,
    }


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}  # fmt: skip


def sdpa_names(text: str) -> str:
    """``--sdpa``'s value, checked: comma-separated keys of `SDPA_BACKENDS` (empty: torch's own choice)."""
    unknown = [n for n in text.split(",") if n and n not in SDPA_BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"no kernel {', '.join(unknown)}; choose among {', '.join(SDPA_BACKENDS)}")
    return text


def attention_kernels(names: str) -> contextlib.AbstractContextManager[object]:
    """``torch.nn.attention.sdpa_kernel`` limited to ``names`` (checked by `sdpa_names`); no names: torch's own
    choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wanted = [n for n in names.split(",") if n]
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in wanted]) if wanted else contextlib.nullcontext()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.builder", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=PROXY_MODEL)
    p.add_argument("--corpus", type=Path, default=VITAL)
    p.add_argument("--articles", type=int, default=200, help="the first N articles of the corpus")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--batch-tokens", default="4096", help="the builder's token budget(s) per batch, comma-separated "
                   "(0: rows alone): one set of runs each")  # fmt: skip
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--articles-per-shard", type=int, default=25, help="small, so the worker prepares ahead")
    p.add_argument("--workers", type=int, default=1, help="tokenising worker processes (the build's default)")
    p.add_argument("--checkpoint-contexts", type=int, default=BuildSettings.model_fields["checkpoint_contexts"].default,
                   help="rows per embedding step (the build's default): each step's batches are cut from its "
                   "length-sorted rows, so a step of few batches pads like unsorted ones")  # fmt: skip
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--backend", default="eager", help="forward backend(s) of the build, comma-separated: runs "
                   "alternate between them (e.g. eager,onnx); each run's bare forward uses its own backend")
    p.add_argument("--codec", default="fp16", help="codec(s) of the build, comma-separated (fp16,int8,pq): one set of "
                   "runs each")
    p.add_argument("--code-bytes", type=int, default=0, help="pq: bytes per code (0: auto)")
    p.add_argument("--sdpa", type=sdpa_names, default="", help="attention kernels the forward may use, comma-separated (flash, "
                   "efficient, cudnn, math; default: torch's choice): on a GPU, whether one of them costs the build "
                   "per new batch shape")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "builder.json")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    tmp = Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    corpus = tmp / f"first{args.articles}.jsonl"
    with open(args.corpus, encoding="utf-8") as f:
        corpus.write_text("".join(islice(f, args.articles)), encoding="utf-8")
    torch.set_num_threads(cpu_quota_threads())
    backends = [b for b in args.backend.split(",") if b]
    encoders = {b: MaskedLMEncoder.load(str(args.model), device=args.device, dtype=args.dtype,
                                        max_seq_len=args.max_seq_len) for b in backends}  # fmt: skip
    encoder = encoders[backends[0]]
    codecs = [c for c in args.codec.split(",") if c]
    budgets = [int(t) for t in args.batch_tokens.split(",") if t]

    with attention_kernels(args.sdpa):
        runs = [one_run(encoders[b], corpus, args, b, c, t) for c in codecs
                for t in budgets for _ in range(args.runs) for b in backends]  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    result = _result(args, encoder, runs)
    write_json(args.out, result)
    sys.stdout.write(
        f"builder: {args.model.name}, layer {encoder.layer}, {result['device']} {result['dtype']}, "
        f"{torch.get_num_threads()} threads, {result['corpus']}\n" + "\n".join(_table(result, runs))
        + f"\nwrote {args.out}\n"
    )
    return 0


def _result(args: argparse.Namespace, encoder: MaskedLMEncoder, runs: list[dict[str, object]]) -> dict[str, object]:
    """The report: settings, machine, every run, the peak memory."""
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result: dict[str, object] = {
        "benchmark": "builder",
        "model": args.model.name,
        "layer": encoder.layer,
        "device": str(encoder.device),
        "dtype": str(encoder.dtype).removeprefix("torch."),
        "corpus": f"{args.corpus.name} first {args.articles}",
        "settings": {
            "batch_size": args.batch_size,
            "max_seq_len": args.max_seq_len,
            "articles_per_shard": args.articles_per_shard,
            "checkpoint_contexts": args.checkpoint_contexts,
            "workers": args.workers,
            "sdpa": args.sdpa or "torch's choice",
            "sparse_indexes": False,
        },
        "machine": machine(),
        "runs": runs,
        # This process (model, forward, shard writing); the tokenising worker process is not included
        # (RUSAGE_CHILDREN would report the parent's size, counted at fork before the worker's exec).
        "peak_rss_mib": round(rss_self / 1024, 1),
    }
    return result


_ROWS = [
    ("backend", "backend"),
    ("forward", "forward"),
    ("batch tokens", "batch_tokens"),
    ("padding fraction", "padding_fraction"),
    ("codec", "codec"),
    ("contexts", "contexts"),
    ("build ctx/s", "build_ctx_per_s"),
    ("bare forward ctx/s", "bare_forward_ctx_per_s"),
    ("forward ctx/s inside build", "forward_in_build_ctx_per_s"),
    ("ctx/s from first batch to last", "embed_span_ctx_per_s"),
    ("build / bare forward", "build_over_forward"),
    ("backend setup s (untimed)", "backend_setup_s"),
    ("bytes/context (shard files)", "bytes_per_context_shards"),
    ("bytes/context (whole dir)", "bytes_per_context_dir"),
    ("bytes/context (no text)", "bytes_per_context_without_text"),
    ("text bytes/context", "text_bytes_per_context"),
    ("codec file bytes", "codec_file_bytes"),
]


def _table(result: dict[str, object], runs: list[dict[str, object]]) -> list[str]:
    """The printed table: one column per run, then run 1's stages and what bound it."""
    lines = [f"{'':30}" + "".join(f"{'run ' + str(i + 1):>12}" for i in range(len(runs)))]
    lines += [f"{label:30}" + "".join(f"{r[key]!s:>12}" for r in runs) for label, key in _ROWS]
    lines.append(f"{'peak RSS MiB (main process)':30}{result['peak_rss_mib']:>12}")
    lines.append("per stage, seconds (items/s per process), run 1:")
    stages: dict[str, dict[str, Any]] = runs[0]["stages"]  # type: ignore[assignment]
    for name, st in stages.items():
        rate = next((v for k, v in st.items() if k.endswith("_per_s_per_process")), None)
        lines.append(f"  {name:12} {st['seconds']:>9.2f} s  ({rate} per s)")
    lines.append(f"  bound: {runs[0]['bound']}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
