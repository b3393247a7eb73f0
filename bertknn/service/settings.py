"""Service settings: pydantic-settings, nested groups, env prefix ``BERTKNN_`` and ``__`` for nesting.

Examples: ``BERTKNN_DATASTORE=/data/ds``, ``BERTKNN_CACHE__REDIS_URL=redis://:pw@redis:6379/0``,
``BERTKNN_MODEL__DEVICE=cuda``, ``BERTKNN_BATCHING__MAX_WAIT_MS=5``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bertknn.core.encoder import BackendName
from bertknn.core.logs import LogFormat
from bertknn.core.onnx_cache import SETTING_HELP as ONNX_CACHE_HELP
from bertknn.core.vocab_cache import SETTING_HELP as VOCAB_CACHE_HELP
from bertknn.service.interpolate import (
    DEFAULT_ARTICLE_SHARPNESS,
    DEFAULT_MLM_PRIOR,
    AdaptiveRule,
    Interpolation,
)
from bertknn.service.results import RetrieverName


class ModelSettings(BaseModel):
    model_config = {"protected_namespaces": ()}
    name: str | None = Field(None, description="masked LM name or directory; default: the one the manifest names")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = the container's CPU quota less one (at least 1), which "
        "leaves a core to the HTTP, retrieval and kNN threads"
    )
    backend: BackendName = Field(
        "auto", description="forward pass: onnx (ONNX Runtime, CPU, float32), eager, or auto (onnx on the CPU, eager "
        "on a GPU). onnx is checked against the eager forward at start-up "
        "and falls back when it cannot be built or differs"
    )
    onnx_cache: str = Field("auto", min_length=1, description=ONNX_CACHE_HELP)
    vocab_cache: str = Field("auto", min_length=1, description=VOCAB_CACHE_HELP)
    cuda_graphs: bool = Field(
        True, description="on a GPU with the eager backend: the forward replayed as CUDA graphs, one per (rows, "
        "width) bucket, each used once it gave the eager forward's outputs; eager where capture fails or differs. "
        "Short and medium questions' buckets are captured at start-up, others when first needed"
    )
    cuda_wait: Literal["spin", "block"] = Field(
        "spin", description="on a GPU, how the model thread waits for its forward pass: spin (CUDA's default: it "
        "busy-waits on its core) or block (it sleeps until the device signals, leaving the core to the host work of "
        "the other processes sharing the GPU; meant for several --workers per GPU). "
        "docs/decisions/serving-processes.md"
    )
    knn_device: Literal["host", "model"] = Field(
        "host", description="where a batch's restricted kNN runs: host (FAISS over each question's rows, one question "
        "at a time) or model (the model's device: after the batch's forward pass, the rows of its questions whose "
        "articles are known are searched there in one batched pass, kept there or copied: knn_device_rows; float16 "
        "datastores, fixed interpolation; the others stay on the host). docs/decisions/serving-processes.md"
    )
    knn_device_rows: Literal["auto", "resident", "copied"] = Field(
        "auto", description="with knn_device model, how the questions' rows reach the device: resident (the "
        "datastore's float16 rows kept there, loaded at start-up and, after a reload, a step after each batch; only "
        "row ids cross), copied (each batch's rows copied from the host), or auto (resident on a GPU where the rows "
        "take at most half of its free memory, else copied)"
    )
    vote_device: Literal["host", "model"] = Field(
        "host", description="with knn_device model, where the questions searched on the device are voted: host "
        "(their vote, interpolation and top-k one question at a time) or model (the whole batch's in a few tensor "
        "operations there; only the answers' ids and probabilities come back; word answers of wordpiece "
        "datastores, the others stay on the host). docs/decisions/serving-processes.md"
    )
    knn_only: bool = Field(
        False, description="serve a checkpoint without its MLM head: p_MLM is uniform and the answers are the "
        "neighbours' alone (without this, such a checkpoint is refused at start-up)"
    )


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what the Redis client takes


class CacheSettings(BaseModel):
    redis_url: SecretStr | None = Field(
        None, description="redis://, rediss:// or unix:// URL (its password is kept secret); unset = in-process LRU cache"
    )
    key_prefix: str = Field("bertknn", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    ttl_s: int = Field(86400, ge=1)
    lru_size: int = Field(4096, ge=0)
    timeout_ms: int = Field(50, ge=1, le=10000, description="socket timeout of one Redis call")
    mlm_top_entries: int = Field(2048, ge=16, description="p_MLM entries kept in the cache (float16)")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: SecretStr | None) -> SecretStr | None:
        # refused here in one line, not by the Redis client at start-up; only the scheme is shown (the URL may
        # hold the password)
        url = "" if value is None else value.get_secret_value()
        if value is not None and not url.startswith(REDIS_SCHEMES):
            scheme, sep, _ = url.partition("://")
            got = f"scheme {scheme!r}" if sep and scheme else "no scheme"
            raise ValueError(f"a Redis URL starts with {', '.join(REDIS_SCHEMES)} (this one has {got})")
        return value


class BatchingSettings(BaseModel):
    max_batch_size: int = Field(32, ge=1, le=1024)
    max_wait_ms: float = Field(
        0.0, ge=0, le=1000, description="extra wait for company when the model is idle (requests that arrive while "
        "it is busy are batched anyway)"
    )
    max_queue: int = Field(256, ge=1, description="queued queries before 503 + Retry-After")
    merged_rows: int = Field(
        64, ge=1, le=4096, description="with layout split: the most rows the model process merges into one forward "
        "pass from the batches the API processes send at the same time"
    )
    on_event_loop: bool = Field(
        False, description="run each batch (its forward pass and the answers finished after it) on the event loop's "
        "thread instead of a model thread: no hand-offs of the GIL between the two, but no request is read or "
        "answered, not even from the cache, while a batch or a whole word's or entity's extra forward pass runs; "
        "meant for several --workers per device (docs/decisions/serving-processes.md)"
    )


class LimitSettings(BaseModel):
    max_body_bytes: int = Field(1_000_000, ge=1024)
    max_text_chars: int = Field(2000, ge=16)
    max_batch_queries: int = Field(64, ge=1)
    max_top_k: int = Field(100, ge=1)
    max_k: int = Field(2048, ge=1)
    max_num_articles: int = Field(50, ge=1)
    max_follow_hops: int = Field(4, ge=1, description="relations in one /follow request")
    max_beam: int = Field(20, ge=1, description="a /follow hop's beam: queries per hop")
    deadline_ms: int = Field(
        5000, ge=50, le=600_000, description="how long a request may run (a request's own deadline_ms may only be "
        "shorter); past it the request is answered 504 with Retry-After and its remaining work is dropped"
    )
    max_request_cost: int = Field(
        512, ge=1, description="forward rows one request is estimated to run (docs/limits.md); a request over it is "
        "a 422 that names this cap"
    )
    max_client_cost: int = Field(
        512, ge=1, description="forward rows one client may have in flight; more is a 429 with Retry-After"
    )
    max_queued_cost: int = Field(
        4096, ge=1, description="forward rows all requests may have in flight; more is a 503 with Retry-After"
    )
    client_header: str | None = Field(
        None, min_length=1, max_length=64, description="the request header that names the client (e.g. one a "
        "gateway sets from the API key); unset: the peer's address"
    )


class DefaultsSettings(BaseModel):
    retriever: RetrieverName = "bm25"
    num_articles: int = Field(3, ge=1)
    k: int = Field(128, ge=1)
    temperature: float | Literal["auto"] = Field(
        "auto",
        description="l in softmax(-d/l): a number, or auto: the builder's measured factor times the median distance of "
        "each query's own neighbours (the paper's 6 for a datastore without the measurement)",
    )

    @field_validator("temperature")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and not value > 0:
            raise ValueError("temperature must be > 0, or auto")
        return value
    lambda_: float = Field(0.3, ge=0, le=1, alias="lambda")
    mlm_prior: float = Field(
        DEFAULT_MLM_PRIOR, ge=0, le=4, description="the neighbours' vote for a word is weighted by p_MLM(word) to "
        "this power, so that words that fit the question win the article's votes (0: the paper's plain vote; "
        "word answers, not entity answers)",
    )
    article_sharpness: float = Field(
        DEFAULT_ARTICLE_SHARPNESS, ge=0, le=100, description="neighbours from articles the ranker scored lower count "
        "less: each one's weight times exp(-article_sharpness * (1 - its article's score / the top score)); 0: every "
        "retrieved article counts the same (the paper's)",
    )
    top_k: int = Field(10, ge=1)
    interpolation: Interpolation = Field("fixed", description="fixed: lambda; adaptive: adaptive_rule per query")
    # BERTKNN_DEFAULTS__ADAPTIVE_RULE may be the path of a rule JSON (`python -m evaluation lama --adaptive-out`)
    # or a JSON object; single fields also work: BERTKNN_DEFAULTS__ADAPTIVE_RULE__SKIP_THRESHOLD=0.8
    adaptive_rule: Annotated[AdaptiveRule, NoDecode] = Field(default_factory=AdaptiveRule)

    model_config = {"populate_by_name": True}

    @field_validator("adaptive_rule", mode="before")
    @classmethod
    def _rule_file(cls, value: Any) -> Any:
        if isinstance(value, str | Path):
            text = str(value).strip()
            return json.loads(text) if text.startswith("{") else AdaptiveRule.load(text)
        return value


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BERTKNN_", env_nested_delimiter="__", extra="ignore", protected_namespaces=(),
        hide_input_in_errors=True,  # an error's text never shows what was given: it may be a secret (a Redis URL)
    )

    datastore: Path = Field(Path("datastore"), description="datastore directory built by datastore_builder")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: LogFormat = Field(
        "text", description="text: one line per record (time, level, process where several serve, logger, "
        "message); json: one JSON object per line, a request's fields (id, status, latency, cache, stage times) as "
        "keys of their own, for a log collector"
    )
    verify_checksums: bool = Field(
        False, description="at start-up and reload, run the full `validate` (every article, every shard file hashed; "
        "slow on big datastores) instead of the quick check (manifest, file sizes, article table identity)"
    )
    graceful_shutdown_s: int = Field(
        25, ge=0, le=3600, description="after SIGTERM, how long requests in flight may take to finish (uvicorn's "
        "timeout_graceful_shutdown); keep it below Kubernetes' terminationGracePeriodSeconds less the preStop sleep"
    )
    admin_token: SecretStr | None = Field(None, description="bearer token for /admin endpoints; unset disables them")
    workers: int = Field(
        0, ge=0, le=64, description="server processes behind the port (uvicorn's supervisor replaces one that "
        "dies), each with the model loaded, or with layout split beside one model process; 0 = auto: 1 on a CPU, "
        "on a GPU half the cores (2 to 8). torch threads are split between the processes that run the model "
        "(docs/decisions/serving-processes.md)"
    )
    layout: Literal["full", "split"] = Field(
        "full", description="full: each of the --workers processes loads the model and answers its requests from "
        "start to end; split: the --workers processes answer HTTP, retrieve, search and vote, and send their "
        "forward passes to one model process, which merges those of all of them into one batch "
        "(docs/decisions/serving-processes.md)"
    )
    warmup: bool = Field(
        True, description="before a server process says it is ready, it runs a few questions of its own the whole "
        "way (nothing of them cached or counted), so that no client's first request pays for what a process runs once"
    )
    reload_wait_s: float = Field(
        60.0, ge=0, le=3600, description="with several processes, how long POST /admin/reload waits for every "
        "process to serve the new version before it answers"
    )
    reload_poll_s: float = Field(
        0.0, ge=0, le=3600, description="check the datastore's manifest this often and serve a new version when one "
        "appears (0 = off; POST /admin/reload works either way)"
    )
    # BERTKNN_MODEL may be a plain name or path (as the quick start and the builder use it) or a JSON object
    model: Annotated[ModelSettings, NoDecode] = Field(default_factory=ModelSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    jvm_options: str = Field(
        "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        description="options for the JVM that runs Lucene (BM25), separated by spaces: by default the C1 JIT only "
        "and the serial GC (docs/decisions/jvm-flags.md); '' keeps the JVM's defaults",
    )
    opentelemetry: bool = Field(
        False, description="FastAPI's native OpenTelemetry spans, metrics and logs, sent to the providers the process "
        "configures. Off by default: the service has its own Prometheus metrics and request ids, and with it on, "
        "FastAPI looks for providers on every request",
    )
    limits: LimitSettings = Field(default_factory=LimitSettings)
    defaults: DefaultsSettings = Field(default_factory=DefaultsSettings)

    @field_validator("model", mode="before")
    @classmethod
    def _model_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("{") else {"name": text}
        return value

    @model_validator(mode="after")
    def _check(self) -> ServiceSettings:
        d, lim = self.defaults, self.limits
        for name, value, limit in (("top_k", d.top_k, lim.max_top_k), ("k", d.k, lim.max_k)):
            if value > limit:
                raise ValueError(f"defaults.{name} {value} exceeds limits.max_{name} {limit}: lower the default, or "
                                 "raise the limit")  # fmt: skip
        if self.model.vote_device == "model" and self.model.knn_device != "model":
            raise ValueError("model.vote_device model votes the questions searched on the device: set "
                             "model.knn_device to model as well, or vote_device to host")
        if self.layout == "split" and (self.model.knn_device == "model" or self.batching.on_event_loop):
            raise ValueError("layout split runs the model in a process of its own: model.knn_device model and "
                             "batching.on_event_loop need the model in the serving process (layout full)")
        return self
