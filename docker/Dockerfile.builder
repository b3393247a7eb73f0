# syntax=docker/dockerfile:1
# BERT-kNN datastore builder: CUDA torch, runs on CPU too (--device cpu, or `auto` when no GPU is visible).
#   docker build -f docker/Dockerfile.builder -t bertknn-builder:latest .
#   docker run --gpus 1 -v corpus:/corpus:ro -v datastore:/data -v hf:/models/hf bertknn-builder:latest \
#       build --corpus /corpus/enwiki.jsonl --out /data/datastore
# Sharded: `build ... --shard-index I --num-shards N --out /data/slices/slice-I` per worker, then
# `merge /data/slices/slice-* --out /data/datastore` (the Kubernetes Indexed Job in k8s/jobs does exactly this).
# The CUDA libraries come with the torch and faiss-gpu wheels (nvidia-*-cu12 wheels), so the base is the same slim
# Python image as the service; the host needs only the NVIDIA driver: 525.60.13 or newer for the default, CUDA 12.8
# (docs/deployment.md, "GPU drivers"; the process checks the driver at start-up and says which one it needs).
# Runs `python -m datastore_builder` as uid 10001.  Model weights are not in the image: mount a Hugging Face cache at
# /models/hf (HF_HOME; docker/prefetch_model.py fills it) or a model directory (--model DIR).  The JRE is here for
# the Lucene (BM25) index the build ends with.  See README.md, "Deployment".

# python:3.11.14-slim-bookworm (multi-arch index digest); bump tag and digest together.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# ---------------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_PREFER_BINARY=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Optional, for builds behind a TLS-inspecting proxy or with a local wheelhouse (pip reads both from the environment):
# PIP_CERT, a CA bundle mounted into the build (never over the image's own bundle); PIP_FIND_LINKS, a directory of
# wheels (e.g. the torch wheel) mounted into the build.  Unset by default; scripts/compose_smoke.sh sets them.
ARG PIP_CERT
ARG PIP_FIND_LINKS

# torch first, the CUDA build: on PyPI the Linux x86_64 torch wheel is the CUDA one. 2.10.0 is PyPI's last torch
# built for CUDA 12 (12.8), which starts on driver 525.60.13 and newer; 2.11 and later are CUDA 13 builds (driver
# 580). For a CPU-only builder (no GPU on the box, a quarter of the size) build with --build-arg TORCH_VARIANT=cpu,
# --build-arg TORCH_VERSION=2.13.0 and --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; the check
# below fails a build that got the other.
ARG TORCH_VERSION=2.10.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TORCH_VARIANT=cuda
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The project and its dependencies from pyproject.toml (the context holds only what .dockerignore allows). The CUDA
# variant then takes faiss-gpu instead of faiss-cpu (both provide the module `faiss`: never both), so that
# `ivfpq` trains and fills the index on the GPU (bertknn.builder.ivfpq.on_gpus); faiss-gpu 1.15.1 is built for
# CUDA 12 (sm_90 code for Hopper) and takes the same CUDA 12 runtime wheels as torch 2.10.
ARG FAISS_GPU_VERSION=1.15.1
COPY . /src
RUN pip install "/src[thai]" \
    # the thai extra: PyThaiNLP's sentence segmenter, for Thai dumps (docs/languages.md)
    # pyserini 0.25 without its heavy optional dependencies (nmslib, spacy, lightgbm): BM25 needs none of them.
    && pip install --no-deps "pyserini==0.25.0" \
    && if [ "${TORCH_VARIANT}" = cuda ]; then \
        pip uninstall -y faiss-cpu && pip install "faiss-gpu==${FAISS_GPU_VERSION}" \
        && python -c "import faiss; assert hasattr(faiss, 'StandardGpuResources'), 'faiss has no GPU support'"; \
    fi \
    && python -c "import sys, torch; cuda = bool(torch.version.cuda); sys.exit(None if cuda == (sys.argv[1] == 'cuda') else f'TORCH_VARIANT={sys.argv[1]} but torch {torch.__version__} was installed')" "${TORCH_VARIANT}"

# ---------------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# JRE 17 for Lucene (pyserini's BM25 searcher runs in the JVM through pyjnius).  The man directory must exist for the
# JRE's post-install script on slim images.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/* /var/log/apt /var/log/dpkg.log \
    && ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java \
    && groupadd --system --gid 10001 bertknn \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/bertknn --create-home --shell /usr/sbin/nologin bertknn \
    && mkdir -p /data /models/hf /cache/onnx \
    && chown 10001:10001 /data /models /models/hf /cache /cache/onnx

COPY --from=build /opt/venv /opt/venv
COPY docker/healthcheck.py docker/prefetch_model.py /opt/bertknn/

# DL3064: TOKENIZERS_PARALLELISM trips the secret heuristic ("TOKEN"); no secret is set here.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    JAVA_HOME=/opt/java \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    # Everything that caches (onnxruntime, torch, triton) writes under /tmp: the only writable path needed.
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/models/hf \
    TOKENIZERS_PARALLELISM=false \
    # The NVIDIA container runtime mounts the driver's compute libraries only (no graphics) into the container.
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 10001:10001
WORKDIR /home/bertknn
# Fail the image build, not the first request, when a package, the bundled data files or the JVM are missing.
RUN python -c "import bertknn.service.settings, bertknn.builder.targets as t; t.load_stopwords(); from bertknn.core.lucene import ready_pyserini_env; ready_pyserini_env(); from pyserini.search.lucene import LuceneSearcher" \
    && rm -rf /tmp/.cache /tmp/hsperfdata_bertknn

# A one-shot job, not a server: nothing to probe.
HEALTHCHECK NONE
ENTRYPOINT ["python", "-m", "datastore_builder"]
CMD ["--help"]
