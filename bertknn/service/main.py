"""create_app(settings) + lifespan: the only wiring code."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import BertKnnError
from bertknn.core.libc import name_os_thread
from bertknn.core.logs import Event
from bertknn.core.vocab_cache import VocabCache
from bertknn.service import heap
from bertknn.service.api.admin import router as admin_router
from bertknn.service.api.docs import install_docs
from bertknn.service.api.errors import install_error_handlers
from bertknn.service.api.follow import router as follow_router
from bertknn.service.api.middleware import BodyLimitMiddleware, RequestContextMiddleware
from bertknn.service.api.routes import router
from bertknn.service.api.ui import router as ui_router
from bertknn.service.cache import Cache, InMemoryCache, RedisCache
from bertknn.service.device_vote import DeviceVote
from bertknn.service.jvm import configure_jvm
from bertknn.service.metrics import Metrics
from bertknn.service.model_client import RemoteEncoder
from bertknn.service.model_load import default_threads, prepare_forward
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.processes import WorkerSlot, run_dir_from_env
from bertknn.service.reload import DatastoreReloader, PeerReloads
from bertknn.service.resources import Resources
from bertknn.service.retrieval.device_knn import DeviceKnn
from bertknn.service.retrieval.resident_rows import ResidentRows, fits_in_half_the_free_memory
from bertknn.service.serving import AsyncAnswerer
from bertknn.service.settings import ServiceSettings
from bertknn.service.shared_gate import SharedCostGate
from bertknn.service.warmup import warm_up

logger = logging.getLogger("service")


def make_cache(settings: ServiceSettings) -> Cache:
    c = settings.cache
    if c.redis_url:
        cache = RedisCache(c.redis_url.get_secret_value(), ttl_s=c.ttl_s, timeout_ms=c.timeout_ms)
        if not cache.ping():
            logger.warning("redis at start-up: unreachable; serving with the cache bypassed until it answers")
        return cache
    return InMemoryCache(c.lru_size)


def open_pipeline(settings: ServiceSettings) -> AnswerPipeline:
    """The pipeline with its model loaded here, or (layout split) with the model process's (`RemoteEncoder`)."""
    remote = RemoteEncoder.from_env()
    # an API process of the split layout runs no forward pass: one thread for what torch it calls
    torch.set_num_threads(1 if remote is not None else settings.model.threads or default_threads(settings.workers))
    jvm_options = settings.jvm_options.split()
    if jvm_options and not configure_jvm(jvm_options):
        logger.warning("jvm_options ignored: the JVM of this process is already running")
    pipeline = AnswerPipeline.open(
        Path(settings.datastore).resolve(),  # a symlink is followed once: a reload re-resolves it
        model=settings.model.name,
        device=settings.model.device,
        dtype=settings.model.dtype,
        cache=make_cache(settings),
        key_prefix=settings.cache.key_prefix,
        mlm_top_entries=settings.cache.mlm_top_entries,
        verify_checksums=settings.verify_checksums,
        mlm_head="knn-only" if settings.model.knn_only else "required",
        vocab_cache=VocabCache.from_setting(settings.model.vocab_cache),
        encoder=remote,
    )
    enc = pipeline.encoder
    if isinstance(enc, MaskedLMEncoder):
        backend = prepare_forward(enc, settings, max_rows=settings.batching.max_batch_size)
    else:
        backend = enc.backend
    built, served = pipeline.datastore.manifest.model.numerics, enc.numerics
    other = (
        "" if built in (None, served)
        else f"; the datastore was embedded as {built}, within the measured rounding (docs/decisions/numerics.md)"
    )  # fmt: skip
    logger.info("model backend: %s (%s), %d torch threads%s", backend, served, torch.get_num_threads(), other)
    return pipeline


def create_app(
    settings: ServiceSettings, *, pipeline_factory: Callable[[ServiceSettings], AnswerPipeline] | None = None
) -> FastAPI:
    resources = _resources(settings)
    factory = pipeline_factory or open_pipeline

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watch = await _start(app, resources, factory)  # (no reference to the pipeline here: a reload retires it)
        try:
            yield
        finally:
            await _stop(resources, watch)
            if resources.slot is not None:
                resources.slot.release()

    app = FastAPI(
        title="BERT-kNN",
        version="0.1.0",
        description="Cloze question answering: a masked LM interpolated with kNN over an embedded Wikipedia "
        "(Kassner & Schütze 2020).",
        lifespan=lifespan,
        telemetry=None if settings.opentelemetry else {"tracing": False, "metrics": False, "logs": False},
        docs_url=None,  # install_docs serves Swagger UI from local assets instead of a CDN
        redoc_url=None,
        redirect_slashes=False,  # /predict/ is a 404 that names /predict, never a 307 with an empty body
    )
    app.state.resources = resources
    app.state.startup_error = None
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(follow_router)
    app.include_router(admin_router)
    app.include_router(ui_router)
    install_docs(app)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)  # type: ignore[arg-type]
    # outermost: every response (a 413 from the body limit too) carries the request id and is counted
    app.add_middleware(RequestContextMiddleware, resources=resources)  # type: ignore[arg-type]
    return app


def _resources(settings: ServiceSettings) -> Resources:
    """The app's resources; in one of several server processes (`bertknn.service.processes`), with its slot,
    the shared cost gate and the shared metrics."""
    run_dir = run_dir_from_env()
    if run_dir is None:
        return Resources(settings=settings)
    resources = Resources(settings=settings, metrics=Metrics(run_dir / "metrics"))
    resources.slot = WorkerSlot.claim(run_dir)
    resources.gate = SharedCostGate(resources.gate.caps, run_dir, resources.slot)
    return resources


def _warn_default_retriever(settings: ServiceSettings, pipeline: AnswerPipeline) -> None:
    """One line at start-up when requests that name no retriever would all be refused (a datastore built with
    --no-bm25, served with the default bm25), naming the setting that fixes it."""
    default, have = settings.defaults.retriever, sorted(pipeline.retrievers)
    if default != "none" and default not in have:
        logger.warning(
            "the default retriever %r has no index in this datastore (it has: %s): requests that name no retriever "
            "are refused; set BERTKNN_DEFAULTS__RETRIEVER to one it has", default, ", ".join(have) or "none",
        )


async def _start(
    app: FastAPI, resources: Resources, factory: Callable[[ServiceSettings], AnswerPipeline]
) -> asyncio.Task[None] | None:
    """Load the pipeline on the model's thread (``resources.pipeline``), start the answerer and the reload watch;
    then ready. Returns the watch's task."""
    settings = resources.settings
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="model", initializer=name_os_thread)
    # several processes: the reload generation read before the model loads, so none announced meanwhile is missed
    peers = PeerReloads(resources.slot.root, resources.slot.index) if resources.slot is not None else None
    try:
        # loaded on the thread that will run every forward pass (one OpenMP team; see AsyncAnswerer)
        pipeline = await asyncio.get_running_loop().run_in_executor(model_thread, factory, settings)
    except Exception as exc:
        model_thread.shutdown(wait=False)
        logger.error("start-up failed: %s", exc)
        if isinstance(exc, BertKnnError):  # explained in that line: `bert-knn serve` shows no traceback
            app.state.startup_error = str(exc)
        raise
    resources.pipeline = pipeline
    _warn_default_retriever(settings, pipeline)
    if settings.warmup:  # a few questions of its own, so that no client's first request pays for what runs once
        await asyncio.get_running_loop().run_in_executor(model_thread, warm_up, pipeline, settings)
    resources.metrics.watch_cache(pipeline.cache)
    device_knn = _device_knn(settings, pipeline)
    if device_knn is not None and device_knn.resident is not None:  # (on the model's thread, as every torch call)
        await asyncio.get_running_loop().run_in_executor(model_thread, _keep_rows, device_knn, pipeline)
    device_vote = None
    if settings.model.vote_device == "model":  # (made on the model's thread, as every torch call)
        device_vote = await asyncio.get_running_loop().run_in_executor(model_thread, _device_vote, pipeline)
    resources.answerer = AsyncAnswerer(
        pipeline, settings.batching, resources.metrics, model_thread=model_thread, device_knn=device_knn,
        device_vote=device_vote,
    )
    resources.answerer.start()
    reloader = DatastoreReloader(resources, peers=peers)
    resources.reloader = reloader
    watches = [reloader.watch(settings.reload_poll_s)] if settings.reload_poll_s > 0 else []
    if peers is not None:
        reloader.join_peers(pipeline.identity()["datastore"])
        watches += [reloader.follow_peers(), _sync_metrics(resources.metrics)]
    watch = asyncio.create_task(_all(watches)) if watches else None
    frozen = heap.settle()  # what start-up loaded, out of the collector's full passes
    logger.debug("heap: %d objects frozen", frozen)
    resources.ready = True
    resources.metrics.ready.set(1.0)
    logger.info(Event("ready", pipeline.identity()))  # (fields: with --log-format json, keys a log reader reads)
    return watch


def _device_knn(settings: ServiceSettings, pipeline: AnswerPipeline) -> DeviceKnn | None:
    """The batch's kNN on the model's device (``model.knn_device``), its rows kept there or copied
    (``model.knn_device_rows``)."""
    if settings.model.knn_device != "model":
        return None
    device = pipeline.queries.encoder.device
    rows = settings.model.knn_device_rows
    if rows == "copied" or (rows == "auto" and device.type != "cuda"):
        return DeviceKnn(device)
    allowed = (lambda nbytes: True) if rows == "resident" else partial(fits_in_half_the_free_memory, device)
    return DeviceKnn(device, resident=ResidentRows(device, allowed))


def _device_vote(pipeline: AnswerPipeline) -> DeviceVote:
    """The batch vote on the model's device (``model.vote_device``), ranking this vocabulary's words."""
    encoder = pipeline.queries.encoder
    return DeviceVote(encoder.device, encoder.words.vocab.non_words)


def _keep_rows(device_knn: DeviceKnn, pipeline: AnswerPipeline) -> None:
    t = time.perf_counter()
    rows = device_knn.keep_rows(pipeline.neighbours_of.datastore)
    resident = device_knn.resident
    if rows and resident is not None:
        logger.info("kNN on the device: %d rows (%.2f GiB) kept there in %.1f s", rows, resident.nbytes / 2**30,
                    time.perf_counter() - t)  # fmt: skip


async def _all(tasks: list[Coroutine[Any, Any, None]]) -> None:
    await asyncio.gather(*tasks)


async def _sync_metrics(metrics: Metrics, interval_s: float = 1.0) -> None:
    """Several processes: this one's cache counts into the shared metrics, whichever process is scraped."""
    while True:
        await asyncio.sleep(interval_s)
        metrics.sync()


async def _stop(resources: Resources, watch: asyncio.Task[None] | None) -> None:
    """Not ready, draining; the reload watch, the reloader and the answerer stopped, then the pipeline closed."""
    resources.ready = False
    resources.draining = True
    resources.metrics.ready.set(0.0)
    if watch is not None:
        watch.cancel()
    assert resources.reloader is not None and resources.answerer is not None and resources.pipeline is not None
    steps: dict[str, float] = {}
    t = time.perf_counter()
    await resources.reloader.close()
    steps["reloader"], t = time.perf_counter() - t, time.perf_counter()
    await resources.answerer.stop()
    steps["answerer"], t = time.perf_counter() - t, time.perf_counter()
    resources.pipeline.close()  # the version serving last (a reload may have swapped it)
    steps["pipeline"] = time.perf_counter() - t
    heap.thaw()  # an app in a longer-lived process (tests, an embedding app) gives its objects back
    logger.info("stopped (%s)", ", ".join(f"{k} {v:.2f} s" for k, v in steps.items()))
