#!/usr/bin/env bash
# The one command of a GPU lease, run on the device from the repository's root with .gpu carried (made here by
# scripts/gpu_pack.sh): the carried wheels installed, ../shared linked to the carried slice, `python -m bench.gpu`
# with the arguments given, and its results copied to $OUT. On a machine without CUDA, bench.gpu says so and the
# script exits 3 (its rehearsal here: GPU_LEASE_INSTALL=0 bash scripts/gpu_lease.sh --only cuda_graphs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-lease-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ "${GPU_LEASE_INSTALL:-1}" = 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || { echo "gpu_lease: the carried wheels did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# what the results record as their source where the tree is no git checkout (bench.common.source_commit)
[ -s .gpu/source ] && export BERT_KNN_SOURCE="$(cat .gpu/source)"
[ -e ../shared ] || ln -s "$PWD/.gpu/shared" ../shared
# the carried redis-server (gpu_pack.sh): bench.serving's several processes share a Redis cache
[ -x .gpu/redis/bin/redis-server ] && export PATH="$PWD/.gpu/redis/bin:$PATH"
command -v redis-server >/dev/null || echo "gpu_lease: no redis-server: the serving stages with several processes will fail" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
# stopped short of the call's own limit (600 s at most) so that the stages done so far still come back:
# bench.gpu writes gpu.json after every stage
timeout --signal=TERM "${GPU_LEASE_SECONDS:-540}" "$PY" -m bench.gpu "$@" 2>&1 | tee "$OUT/bench-gpu.log"
rc=${PIPESTATUS[0]}
for f in bench/results/gpu.json bench/results/gpu.md bench/results/gpu-*.json bench/results/serving-cuda*.json; do
  [ -f "$f" ] && [ "$f" -nt scripts/gpu_lease.sh ] && cp "$f" "$OUT/"
done
echo "gpu_lease: bench.gpu exited $rc; results in $OUT"
exit "$rc"
