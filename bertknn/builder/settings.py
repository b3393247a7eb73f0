"""Builder settings: CLI flags override environment variables (``BERTKNN_BUILD__<NAME>``, ``BERTKNN_ADD__<NAME>``)
override defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bertknn.builder.targets import TargetMode
from bertknn.core.encoder import BackendName
from bertknn.core.runtime import DeviceName, DtypeName


class BuildSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERTKNN_BUILD__", extra="forbid", protected_namespaces=())

    corpus: list[Path] = Field(default_factory=list, description="corpus files (JSONL or MediaWiki XML dump)")
    model: str = Field("bert-base-uncased", description="Hugging Face masked LM name or local directory")
    out: Path = Field(Path("datastore"), description="output datastore directory")
    layer: int = Field(-2, description="hidden_states index; negative counts from the end (-2 = second-to-last)")
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    batch_size: int = Field(128, ge=1, le=65536)
    max_seq_len: int = Field(128, ge=8, le=4096)
    shard_index: int = Field(0, ge=0)
    num_shards: int = Field(1, ge=1)
    limit_articles: int | None = Field(None, ge=1)
    articles_per_shard: int = Field(
        5000, ge=1, description="articles per block: the unit a parallel build's slices divide (block j: slice j % n)"
    )
    contexts_per_shard: int = Field(
        100_000,
        ge=0,
        description="contexts per shard: a block is written in parts of about this many (cut between articles), "
        "the unit of resume; it bounds the builder's memory. 0: one shard per block",
    )
    index: Path | None = Field(
        None,
        description="the multistream index of the one --corpus dump (default: Wikimedia's "
        "...-multistream-index.txt.bz2 beside it, when there); slices then read only their own streams",
    )
    multistream: bool = Field(True, description="use a multistream dump's index when there is one")
    stopwords: Path | None = None
    min_sentence_chars: int = Field(10, ge=0)
    sparse_indexes: bool = Field(True, description="build BM25 (Lucene) and TF-IDF article indexes")
    ivfpq: bool = Field(False, description="also build the whole-datastore IVF-PQ index (no-retrieval ablation)")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = the container's CPU quota")
    workers: int = Field(1, ge=0, description="processes that split and tokenise ahead of the model; 0 = inline")
    backend: BackendName = Field(
        "eager",
        description="forward: eager PyTorch (the reference), onnx (ONNX Runtime, CPU float32), or auto (onnx on a "
        "CPU, eager on a GPU); onnx is checked against eager before use and falls back if it differs",
    )
    targets: TargetMode = Field(
        "single-piece",
        description="single-piece: words of one wordpiece (the paper); whole-word: words of any number of pieces",
    )

    @model_validator(mode="after")
    def _check(self) -> BuildSettings:
        if self.shard_index >= self.num_shards:
            raise ValueError(f"--shard-index {self.shard_index} must be < --num-shards {self.num_shards}")
        return self


class AddSettings(BaseSettings):
    """``add``: new or changed articles into an existing datastore. What shapes the rows (model, layer,
    max_seq_len, stopwords, targets) comes from its manifest; these are the knobs of the run itself."""

    model_config = SettingsConfigDict(env_prefix="BERTKNN_ADD__", extra="forbid", protected_namespaces=())

    datastore: Path = Field(description="the datastore to update (a finished build, merge or earlier add)")
    corpus: list[Path] = Field(default_factory=list, description="corpus files (JSONL or MediaWiki XML dump)")
    model: str | None = Field(None, description="model name or directory; default: the manifest's. Must be the same weights")
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    batch_size: int = Field(128, ge=1, le=65536)
    articles_per_shard: int | None = Field(None, ge=1, description="default: the manifest's")
    stopwords: Path | None = Field(None, description="the build's stopword file, when it was not the bundled list")
    min_sentence_chars: int | None = Field(None, ge=0, description="default: the build's (build.json), else 10")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = the container's CPU quota")
    workers: int = Field(0, ge=0, description="processes that split and tokenise ahead of the model; 0 = inline")
