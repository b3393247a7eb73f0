"""Builder settings: CLI flags override environment variables (``BERTKNN_BUILD__<NAME>``, ``BERTKNN_ADD__<NAME>``)
override defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bertknn.builder.targets import TargetMode
from bertknn.core.encoder import BackendName
from bertknn.core.format.codec import CodecName, CodecSpec, Rotation
from bertknn.core.languages import corpus_language_code
from bertknn.core.onnx_cache import SETTING_HELP as ONNX_CACHE_HELP
from bertknn.core.runtime import DeviceName, DtypeName
from bertknn.core.vocab_cache import SETTING_HELP as VOCAB_CACHE_HELP


class CodecOptions(BaseModel):
    """How each context's vector is stored (``build``, ``train-codec``, ``recode``)."""

    codec: CodecName = Field(
        "fp16",
        description="how each context's vector is stored: fp16 (the vector), int8 (a byte per dimension) or pq "
        "(product-quantized codes of --code-bytes bytes); int8 and pq are trained once, on the datastore's own "
        "vectors",
    )
    code_bytes: int = Field(0, ge=0, le=1024, description="pq: bytes per code (sub-quantizers); must divide the "
                            "coded dimensions. 0 = auto: the most that keep at least 12 dimensions per byte")
    codec_rotation: Rotation = Field("none", description="pq: rotation before quantizing: none, opq (learned and "
                                     "orthogonal; several times the training time) or pca (to --pca-dim dimensions)")
    pca_dim: int | None = Field(None, ge=1, description="pq with pca rotation: dimensions kept (default: half)")
    codec_train_contexts: int = Field(65536, ge=1, description="int8/pq: contexts the codec is trained on (build: "
                                      "the first ones embedded; recode: a seeded sample of all)")
    codec_seed: int = Field(0, ge=0, description="seed of the codec's training sample and k-means")

    def codec_spec(self) -> CodecSpec:
        """The codec these settings ask for."""
        return CodecSpec(
            self.codec, self.code_bytes, self.codec_rotation, self.pca_dim, self.codec_train_contexts, self.codec_seed
        )


class BuildSettings(CodecOptions, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERTKNN_BUILD__", extra="forbid", protected_namespaces=())

    corpus: list[Path] = Field(default_factory=list, description="corpus files (JSONL or MediaWiki XML dump)")
    model: str = Field("bert-base-uncased", description="Hugging Face masked LM name or local directory")
    out: Path = Field(Path("datastore"), description="output datastore directory")
    layer: int = Field(-2, description="hidden_states index; negative counts from the end (-2 = second-to-last)")
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    batch_size: int = Field(128, ge=1, le=65536, description="most contexts per forward batch")
    batch_tokens: int = Field(
        4096, ge=0, description="most padded tokens per forward batch (contexts x the longest of them; batches "
        "are cut from length-sorted contexts): bounds a batch's memory whatever the lengths. 0: no bound"
    )
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
    checkpoint_contexts: int = Field(
        0, ge=0, description="contexts embedded between the points a Ctrl-C or SIGTERM keeps: an interrupted "
        "build writes the articles embedded so far as a finished part and keeps the rows of an article cut short "
        "for the resume, so at most this much work is lost; each such step's contexts are sorted by length before "
        "they are cut into batches. 0 = auto: 2048 on a CPU, 32 batches of --batch-size on a GPU (a step of few "
        "batches pads them like unsorted ones)"
    )
    index: Path | None = Field(
        None,
        description="the multistream index of the one --corpus dump (default: Wikimedia's "
        "...-multistream-index.txt.bz2 beside it, when there); slices then read only their own streams",
    )
    multistream: bool = Field(True, description="use a multistream dump's index when there is one")
    stopwords: Path | None = Field(
        None, description="a stopword file (one word per line); default: the corpus language's list"
    )
    language: str | None = Field(
        None,
        description="the corpus's language (a Wikipedia code: en, de, ja, uk, vi...) for JSON lines; a dump names "
        "its own (<mediawiki xml:lang>), which this must match. Default: the dump's, else en",
    )
    min_sentence_chars: int = Field(10, ge=0)
    sparse_indexes: bool = Field(True, description="build BM25 (Lucene) and TF-IDF article indexes")
    bm25: bool = Field(
        True,
        description="with the sparse indexes, the BM25 one too (Lucene: pyserini 0.25 and a Java 17 runtime); off: "
        "TF-IDF alone, for a machine without Java (the service then answers requests for bm25 with an error)",
    )
    ivfpq: bool = Field(False, description="also build the whole-datastore IVF-PQ index (no-retrieval ablation)")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = the container's CPU quota")
    workers: int = Field(1, ge=0, description="processes that split and tokenise ahead of the model; 0 = inline")
    backend: BackendName = Field(
        "auto",
        description="forward: auto (onnx on a CPU, eager on a GPU: the fastest measured), eager PyTorch (the "
        "reference), or onnx (ONNX Runtime, CPU float32); onnx is checked against eager before use and falls back "
        "if it differs",
    )
    onnx_cache: str = Field("auto", min_length=1, description=ONNX_CACHE_HELP)
    vocab_cache: str = Field("auto", min_length=1, description=VOCAB_CACHE_HELP)
    targets: TargetMode = Field(
        "single-piece",
        description="single-piece: words of one wordpiece (the paper); whole-word: words of any number of pieces",
    )
    links: bool = Field(
        True,
        description="keep the corpus's entity links (wikilinks, JSON lines \"links\", WikiExtractor anchors): rows "
        "labelled with their link targets, anchors of several words as rows of their own, an entity table",
    )

    codec_from: Path | None = Field(
        None,
        description="a trained codec to use instead of training one: a datastore or `train-codec` output directory "
        "(needed by sliced builds, which must share one codec)",
    )

    @field_validator("language")
    @classmethod
    def _language(cls, value: str | None) -> str | None:
        return None if value is None else corpus_language_code(value)

    @model_validator(mode="after")
    def _check(self) -> BuildSettings:
        if self.shard_index >= self.num_shards:
            raise ValueError(f"--shard-index {self.shard_index} must be < --num-shards {self.num_shards}")
        return self


class RecodeSettings(CodecOptions, BaseSettings):
    """``recode``: a compact copy of an fp16 datastore (codes instead of vectors), without the model."""

    model_config = SettingsConfigDict(env_prefix="BERTKNN_RECODE__", extra="forbid", protected_namespaces=())

    datastore: Path = Field(description="the fp16 datastore to recode (left untouched)")
    out: Path = Field(description="the new datastore's directory (new or empty)")


class AddSettings(BaseSettings):
    """``add``: new or changed articles into an existing datastore. What shapes the rows (model, layer,
    max_seq_len, stopwords, targets) comes from its manifest; these are the knobs of the run itself."""

    model_config = SettingsConfigDict(env_prefix="BERTKNN_ADD__", extra="forbid", protected_namespaces=())

    datastore: Path = Field(description="the datastore to update (a finished build, merge or earlier add)")
    corpus: list[Path] = Field(default_factory=list, description="corpus files (JSONL or MediaWiki XML dump)")
    model: str | None = Field(None, description="model name or directory; default: the manifest's. Must be the same weights")
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    batch_size: int = Field(128, ge=1, le=65536, description="most contexts per forward batch")
    batch_tokens: int = Field(4096, ge=0, description="most padded tokens per forward batch; 0: no bound")
    articles_per_shard: int | None = Field(None, ge=1, description="default: the manifest's")
    stopwords: Path | None = Field(None, description="the build's stopword file, when it was not the bundled list")
    min_sentence_chars: int | None = Field(None, ge=0, description="default: the build's (build.json), else 10")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = the container's CPU quota")
    workers: int = Field(0, ge=0, description="processes that split and tokenise ahead of the model; 0 = inline")
