#!/usr/bin/env bash
# The whole test suite (the README's test command runs this after bootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || bash scripts/bootstrap.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -m "not slow" "$@"
