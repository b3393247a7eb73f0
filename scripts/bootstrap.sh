#!/usr/bin/env bash
# Fresh Debian machine with Python 3.11 -> .venv with everything the project needs (CPU torch, JDK 17 for Lucene).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v java >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends openjdk-17-jdk-headless
  else
    echo "bootstrap: Java 17 is needed for pyserini 0.25 (Lucene); install a JDK 17 and re-run" >&2; exit 1
  fi
fi
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -qq --no-install-recommends redis-server || true
fi
# the playground's browser test drives Debian's headless Chromium (it fails, saying so, where there is none)
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  pkgs="chromium chromium-driver"
  $SUDO apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $pkgs; } \
    || echo "bootstrap: chromium could not be installed; the playground's browser test will fail and say so" >&2
fi
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# CPU torch first so that nothing pulls the CUDA wheels; TORCH_SPEC / TORCH_INDEX_URL override (docker/ uses CUDA).
if ! python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" --index-url "$TORCH_INDEX_URL"
  else
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
# requirements.lock pins every dependency to the versions CI tested (regenerate: see README, "Dependencies")
python -m pip install -q -c requirements.lock -e ".[dev]"
# pyserini 0.25 pairs with JDK 17; its heavy optional deps (nmslib, spacy, lightgbm) are not needed for BM25.
python -m pip install -q --no-deps "pyserini==0.25.0"
echo "bootstrap: ready (.venv)"
