#!/usr/bin/env bash
# Before a GPU lease, here: the unit tests and every model family's integration test under the Hugging Face
# packages of the device's image, which are older than requirements.lock's and are not carried (scripts/gpu_pack.sh
# carries what the image lacks). A break found here costs minutes of this machine, not of the lease.
# IMAGE_PACKAGES overrides the versions (as the image's `pip list` shows them; docs/performance.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
IMAGE_PACKAGES=${IMAGE_PACKAGES:-"transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0"}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# shellcheck disable=SC2086  # one word per package
"$PY" -m pip install -q --no-deps --target "$site" $IMAGE_PACKAGES
PYTHONPATH="$site" "$PY" -c "import transformers, tokenizers, huggingface_hub as h
print('image_check: transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'huggingface_hub', h.__version__)"
# Left out: the check that the service never imports scikit-learn. The image's transformers imports it on its own
# (transformers/generation/candidate_generator.py, at import where scikit-learn is installed); the lock's does not.
PYTHONPATH="$site" "$PY" -m pytest -q -p no:cacheprovider tests/unit tests/integration/test_families.py \
  --deselect tests/unit/test_tfidf.py::test_the_service_never_imports_scikit_learn "$@"
echo "image_check: passed under $IMAGE_PACKAGES"
