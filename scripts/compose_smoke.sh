#!/usr/bin/env bash
# Build the images and run the docker-compose stack end to end with podman, then take it down again.
#
#   bash scripts/compose_smoke.sh [--install]
# Needs podman, runc and debootstrap (Debian: --install gets them with apt) and podman-compose 1.6.0 (installed from
# PyPI into the project's .venv when it is not there).  Exit status 3: podman is missing and could not be installed.
#
# Steps (each one timed; image sizes printed at the end):
#   1. base images: python:3.11-slim-bookworm and redis are pulled when a registry answers; otherwise a Debian root
#      filesystem is made with debootstrap from this machine's apt mirror and imported, and the Python base
#      (docker/Dockerfile.local-python) and Redis (docker/Dockerfile.local-redis, via docker/compose.local.yml) are
#      built on it from Debian's packages;
#   2. the CPU service image (docker/Dockerfile.cpu) and the builder image (docker/Dockerfile.builder, CPU torch);
#   3. the stack from docker-compose.yml: Redis with its password, the one-shot builder writing the sample datastore
#      (data/sample_wiki.jsonl) with a model directory mounted read-only (docker/compose.model-dir.yml), the api
#      reading it read-only;
#   4. checks through the published port: /readyz ready, POST /predict answers the quick start's question with
#      contexts, a repeat is a Redis cache hit and Redis holds the key, the api runs as uid 10001 on a read-only root
#      filesystem, both healthchecks pass; with Redis stopped /predict still answers 200 and /readyz says degraded, and
#      starting Redis again recovers (the first request without Redis answers within 3 s); the api stops on SIGTERM
#      without being killed, its own shutdown within 5 s; started again, it loads the ONNX graph its first start
#      exported into the onnx-cache volume; `down -v` leaves no container, volume or network behind.
#
# Settings (environment):
#   SMOKE_MODEL_DIR   model directory for builder and api (default ../shared/models/proxy-minilm-l6-mlm)
#   SMOKE_PORT        host port of the api (default 18000)
#   SMOKE_WHEELS      directory of wheels handed to pip in the builds, e.g. the local torch wheel (default /opt/wheels
#                     when it exists)
#   SMOKE_CA_BUNDLE   CA bundle pip uses in the builds (default: this machine's, /etc/ssl/certs/ca-certificates.crt)
#   SMOKE_KEEP=1      leave the stack running at the end (take it down with the command printed)
# Exits non-zero at the first failed step or check, after taking the stack down.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODEL_DIR=$(realpath "${SMOKE_MODEL_DIR:-../shared/models/proxy-minilm-l6-mlm}")
PORT=${SMOKE_PORT:-18000}
WHEELS=${SMOKE_WHEELS:-$([ -d /opt/wheels ] && echo /opt/wheels || true)}
CA_BUNDLE=${SMOKE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
PROJECT=bertknn-smoke
PY_IMAGE_REMOTE=docker.io/library/python:3.11.14-slim-bookworm
REDIS_IMAGE_REMOTE=docker.io/library/redis:7.4.7-alpine
DEBIAN_IMAGE=localhost/debian:bookworm
PY_IMAGE_LOCAL=localhost/python:3.11-bookworm
REDIS_IMAGE_LOCAL=localhost/bertknn-redis:bookworm
API_IMAGE=localhost/bertknn:cpu
BUILDER_IMAGE=localhost/bertknn-builder:cpu

if [ "${1:-}" = "--install" ] && ! { command -v podman && command -v runc && command -v debootstrap; } >/dev/null; then
  # dnsname: container names resolve on the networks compose creates (CNI, podman 4 on Debian bookworm).
  { command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
    && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap \
         golang-github-containernetworking-plugin-dnsname >/dev/null; } \
    || { echo "compose_smoke: podman could not be installed (needs root and apt)" >&2; exit 3; }
fi
[ -d "$MODEL_DIR" ] || { echo "compose_smoke: no model directory $MODEL_DIR (set SMOKE_MODEL_DIR)" >&2; exit 2; }
for tool in podman runc; do
  command -v "$tool" >/dev/null || { echo "compose_smoke: $tool is not installed (run with --install)" >&2; exit 3; }
done
WORK=$(mktemp -d)
# podman-compose 1.6.0 from PyPI, in the project's .venv (or a throwaway one): Debian's 1.0.3, which may be on PATH,
# knows no --env-file and no long-form env_file.
VENV=.venv
[ -x "$VENV/bin/python" ] || { VENV="$WORK/venv"; python3 -m venv "$VENV"; }
if [ "$("$VENV/bin/podman-compose" --version 2>/dev/null | head -1)" != "podman-compose version 1.6.0" ]; then
  "$VENV/bin/pip" install -q "podman-compose==1.6.0"
fi
PODMAN_COMPOSE="$VENV/bin/podman-compose"
# The engine's settings for this machine: no default ulimits (refused here), cgroupfs and runc (crun rejects a hybrid
# cgroup layout).  Harmless elsewhere.
cat >"$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

# The stack's settings: a fresh password, the local images, the sample corpus, the model directory.
cat >"$WORK/.env" <<EOF
REDIS_PASSWORD=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
API_BIND=127.0.0.1
API_PORT=$PORT
API_IMAGE=$API_IMAGE
BUILDER_IMAGE=$BUILDER_IMAGE
CORPUS_DIR=$ROOT/data
CORPUS_FILE=sample_wiki.jsonl
MODEL_DIR=$MODEL_DIR
MODEL=/models/model
HF_HUB_OFFLINE=1
BUILD_DEVICE=cpu
BUILD_BATCH_SIZE=32
EOF
COMPOSE_FILES=(-f docker-compose.yml -f docker/compose.model-dir.yml)
compose() { "$PODMAN_COMPOSE" --project-name "$PROJECT" --env-file "$WORK/.env" "${COMPOSE_FILES[@]}" "$@"; }

STEPS=()
step() {  # step NAME COMMAND...: run, time, record
  local name=$1 t0 rc
  shift
  echo "== $name"
  t0=$(date +%s.%N)
  # In a subshell with errexit on: a failing command inside a step function stops that step (errexit is ignored
  # in a function called as `f || ...`).
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  STEPS+=("$(printf '%-58s %7.1f s  %s' "$name" "$(echo "$(date +%s.%N) - $t0" | bc)" "$([ $rc = 0 ] && echo ok || echo FAILED)")")
  if [ $rc != 0 ]; then echo "compose_smoke: FAILED at: $name" >&2; exit $rc; fi
}
fail() { echo "check failed: $*" >&2; return 1; }
report() {
  echo
  echo "== steps"
  printf '%s\n' "${STEPS[@]}"
  echo "== images"
  podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "^($API_IMAGE|$BUILDER_IMAGE|$REDIS_IMAGE_LOCAL|$PY_IMAGE_LOCAL|$DEBIAN_IMAGE|$PY_IMAGE_REMOTE|$REDIS_IMAGE_REMOTE) " \
    | sort -u || true
}
cleanup() {
  local rc=$?
  if [ "${SMOKE_KEEP:-0}" = "1" ] && [ $rc = 0 ]; then
    echo "left running; take it down with: CONTAINERS_CONF=$CONTAINERS_CONF $PODMAN_COMPOSE --project-name $PROJECT --env-file $WORK/.env ${COMPOSE_FILES[*]} down -v"
  else
    compose down -v >/dev/null 2>&1 || true
  fi
  report
  [ "${SMOKE_KEEP:-0}" = "1" ] && [ $rc = 0 ] || rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT

BUILD_ARGS=(--format docker --network host)
if [ -n "$WHEELS" ]; then BUILD_ARGS+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels); fi
if [ -f "$CA_BUNDLE" ]; then BUILD_ARGS+=(-v "$CA_BUNDLE:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt); fi

# --- 1. base images -----------------------------------------------------------------------------------------------
make_debian_base() {
  podman image exists "$DEBIAN_IMAGE" && return 0
  local mirror rootfs
  # The mirror apt on this machine already uses (deb822 sources or a classic sources.list).
  mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/ /etc/apt/sources.list \
    2>/dev/null | head -1 | awk '{print $2}' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  command -v debootstrap >/dev/null || { echo "debootstrap is not installed (run with --install)" >&2; return 1; }
  rootfs="$WORK/rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; return 1; }
  tar -C "$rootfs" -c . | podman import - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$rootfs"
}
base_images() {
  if timeout 60 podman pull -q "$PY_IMAGE_REMOTE" >/dev/null 2>&1 && timeout 60 podman pull -q "$REDIS_IMAGE_REMOTE" >/dev/null 2>&1; then
    echo "pulled $PY_IMAGE_REMOTE and $REDIS_IMAGE_REMOTE"
    return 0
  fi
  echo "no registry: making the bases from Debian's packages"
  make_debian_base
  podman build "${BUILD_ARGS[@]}" -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$PY_IMAGE_LOCAL" \
    -f docker/Dockerfile.local-python docker >/dev/null
  podman build "${BUILD_ARGS[@]}" -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$REDIS_IMAGE_LOCAL" \
    -f docker/Dockerfile.local-redis docker >/dev/null
  echo "REDIS_IMAGE=$REDIS_IMAGE_LOCAL" >>"$WORK/.env"
}
step "base images (pull, or debootstrap + Debian's python3 and redis)" base_images
if grep -q '^REDIS_IMAGE=' "$WORK/.env"; then
  PY_IMAGE=$PY_IMAGE_LOCAL
  COMPOSE_FILES+=(-f docker/compose.local.yml)
else
  PY_IMAGE=$PY_IMAGE_REMOTE
fi

# --- 2. the project's images --------------------------------------------------------------------------------------
build_image() {  # build_image TAG DOCKERFILE [BUILD-ARG...]
  local tag=$1 file=$2
  shift 2
  podman build "${BUILD_ARGS[@]}" --build-arg PYTHON_IMAGE="$PY_IMAGE" "$@" -t "$tag" -f "$file" . \
    >"$WORK/build-$(basename "$file").log" 2>&1 || { tail -40 "$WORK/build-$(basename "$file").log" >&2; return 1; }
}
# The CPU image's torch version (its Dockerfile's default), which the CPU builder image takes too.
torch_version() { sed -n 's/^ARG TORCH_VERSION=//p' "$1"; }
# torch from PyPI's index with the CPU wheel handed over in the wheelhouse when there is one; else the CPU index.
if [ -n "$WHEELS" ]; then TORCH_INDEX=https://pypi.org/simple; else TORCH_INDEX=https://download.pytorch.org/whl/cpu; fi
step "build the CPU service image (docker/Dockerfile.cpu)" \
  build_image "$API_IMAGE" docker/Dockerfile.cpu --build-arg TORCH_INDEX_URL="$TORCH_INDEX"
step "build the builder image, CPU torch (docker/Dockerfile.builder)" \
  build_image "$BUILDER_IMAGE" docker/Dockerfile.builder --build-arg TORCH_INDEX_URL="$TORCH_INDEX" \
  --build-arg TORCH_VARIANT=cpu --build-arg TORCH_VERSION="$(torch_version docker/Dockerfile.cpu)"

# --- 3. the stack -------------------------------------------------------------------------------------------------
compose down -v >/dev/null 2>&1 || true
# -T and stdin from /dev/null: a one-shot job gets no pseudo-terminal and no open stdin, as under any CI.  With a
# terminal asked for where there is none, podman 4.3's `run --rm` once returned while its container stayed
# "running", so nothing removed it and `down -v` could not remove the volumes it held.
step "builder: sample corpus -> datastore volume (compose run)" \
  compose --profile build run -T --rm builder </dev/null
check_run_container_gone() {  # the builder's `run --rm` container is gone (its process exited, podman removed it)
  local name i state pid
  for i in $(seq 1 30); do
    name=$(podman ps -a --filter "name=^${PROJECT}_builder_tmp" --format '{{.Names}}' | head -1)
    [ -n "$name" ] || { echo "the builder's run container is gone"; return 0; }
    sleep 1
  done
  state=$(podman inspect --format '{{.State.Status}}' "$name" 2>/dev/null || echo unknown)
  pid=$(podman inspect --format '{{.State.Pid}}' "$name" 2>/dev/null || echo 0)
  echo "$name is still there 30 s after its run returned: state $state, pid $pid"
  if [ "$pid" -gt 0 ] && kill -0 "$pid" 2>/dev/null; then
    podman top "$name" 2>&1 | sed 's/^/  top: /' || true
    podman logs --tail 20 "$name" 2>&1 | sed 's/^/  log: /' || true
    fail "the builder's process $pid did not exit after its run returned"
  fi
  # Its process is gone and only podman's record of it is left: remove that record, say so, go on.
  podman rm -f "$name" >/dev/null
  echo "its process had exited; podman's record of it is removed"
}
step "builder: its run container is gone" check_run_container_gone
start_api() {
  compose up -d api
  local i
  for i in $(seq 1 180); do
    curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && return 0
    sleep 1
  done
  compose logs api | tail -40 >&2
  fail "/readyz not ready after 180 s"
}
step "up: redis + api, until /readyz answers 200" start_api

# --- 4. checks ----------------------------------------------------------------------------------------------------
API=http://127.0.0.1:$PORT
QUESTION='{"text": "galileo galilei was born in [MASK] .", "subject": "Galileo Galilei", "top_k": 3}'
container() { podman ps -a --filter "label=io.podman.compose.project=$PROJECT" \
  --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1; }
predict() { curl -fsS "$API/predict" -H 'content-type: application/json' -d "$QUESTION"; }
check_ready() {
  curl -fsS "$API/readyz" | tee "$WORK/readyz.json" | python -c \
    'import json,sys; r=json.load(sys.stdin); assert r["status"]=="ready", r; assert r["cache"]["state"]=="ok", r; print("readyz:", r["status"], "cache", r["cache"]["state"])'
}
check_predict() {
  predict >"$WORK/first.json"
  predict >"$WORK/second.json"
  python - "$WORK/first.json" "$WORK/second.json" <<'EOF'
import json, sys
first, second = (json.load(open(p)) for p in sys.argv[1:3])
top = first["predictions"][0]
print("answer:", top["token"], "| its contexts:", len(top["contexts"]), "| cache:", first["cache"], "->", second["cache"])
assert top["token"] == "pisa", first["predictions"]
assert top["contexts"], "no contexts behind the answer"
assert "hit" not in first["cache"].values(), first["cache"]
assert "hit" in second["cache"].values(), second["cache"]
assert second["predictions"] == first["predictions"], "the cached answer differs"
EOF
  local redis keys
  redis=$(container redis)
  keys=$(podman exec "$redis" sh -c 'redis-cli --no-auth-warning --scan --pattern "bertknn*"' | wc -l)
  echo "redis keys under bertknn*: $keys"
  [ "$keys" -ge 1 ] || fail "Redis holds no key of the service"
}
check_hardening() {
  local api uid ro
  api=$(container api)
  uid=$(podman exec "$api" id -u)
  ro=$(podman inspect --format '{{.HostConfig.ReadonlyRootfs}}' "$api")
  echo "api: uid $uid, read-only root filesystem: $ro"
  [ "$uid" = 10001 ] || fail "the api runs as uid $uid"
  [ "$ro" = true ] || fail "the api's root filesystem is writable"
  if podman exec "$api" touch /opt/venv/x 2>/dev/null; then fail "wrote into the api's root filesystem"; fi
}
check_no_password_on_a_command_line() {
  # every process of both containers, and the containers' own commands: the password must appear in none
  local name c password cmdlines spec
  password=$(sed -n 's/^REDIS_PASSWORD=//p' "$WORK/.env")
  [ -n "$password" ] || fail "no REDIS_PASSWORD in $WORK/.env"
  for name in redis api; do
    c=$(container "$name")
    cmdlines=$(podman exec "$c" sh -c 'for f in /proc/[0-9]*/cmdline; do tr "\0" " " <"$f"; echo; done') \
      || fail "cannot list the processes of the $name container"
    printf '%s\n' "$cmdlines" | grep -q "redis-server\|bert-knn\|python" \
      || fail "the $name container's process list shows neither redis-server nor the service: $cmdlines"
    if printf '%s\n' "$cmdlines" | grep -qF "$password"; then
      fail "the Redis password is on a command line in the $name container"
    fi
    spec=$(podman inspect --format '{{.Config.Cmd}} {{.Config.Entrypoint}} {{.Args}}' "$c") \
      || fail "cannot inspect the $name container"
    if printf '%s\n' "$spec" | grep -qF "$password"; then
      fail "the Redis password is in the $name container's command (podman inspect)"
    fi
    echo "$name: $(printf '%s\n' "$cmdlines" | grep -c .) processes, none with the password on its command line"
  done
}
check_healthchecks() {
  # podman runs healthchecks from systemd timers; without systemd they run on demand, which is what this does.
  local name
  for name in redis api; do
    podman healthcheck run "$(container "$name")" || fail "the $name healthcheck fails"
    echo "healthcheck $name: healthy"
  done
}
check_redis_outage() {
  local redis status
  redis=$(container redis)
  podman stop -t 5 "$redis" >/dev/null
  QUESTION='{"text": "marie curie won the nobel prize in [MASK] .", "subject": "Marie Curie", "top_k": 3}'
  # The first request after the stop is the one that finds Redis gone (its name no longer resolves): it must not
  # wait on the resolver's retries. Bound: a cold question's own work plus the cache's timeouts, with CPU slack.
  local took
  read -r status took < <(curl -sS -o "$WORK/outage.json" -w '%{http_code} %{time_total}\n' "$API/predict" \
    -H 'content-type: application/json' -d "$QUESTION")
  echo "redis stopped: /predict $status in ${took} s"
  [ "$status" = 200 ] || fail "/predict answered $status with Redis down"
  python -c "import sys; sys.exit(float(sys.argv[1]) >= 3.0)" "$took" || fail "/predict took ${took} s with Redis down"
  curl -sS "$API/readyz" | python -c \
    'import json,sys; r=json.load(sys.stdin); print("readyz:", r["status"], "cache", r["cache"]["state"]); assert r["cache"]["state"]=="degraded", r'
  podman start "$redis" >/dev/null
  local i
  for i in $(seq 1 60); do
    predict >/dev/null
    if curl -fsS "$API/readyz" | python -c 'import json,sys; sys.exit(json.load(sys.stdin)["cache"]["state"]!="ok")'; then
      echo "redis started again: cache ok after ${i} s"
      return 0
    fi
    sleep 1
  done
  fail "the cache did not recover within 60 s of starting Redis"
}
check_stop() {
  # SIGTERM must end the api within compose's 10 s grace period (no SIGKILL), after the outage above. Two times:
  # the api's own shutdown (uvicorn's "Shutting down" to "Finished server process", from its log: what the code
  # controls, at most 5 s) and the whole `podman stop` (process exit and the container's teardown too).
  local api t0 t1 code
  api=$(container api)
  t0=$(date +%s.%N)
  podman stop -t 10 "$api" >/dev/null
  t1=$(date +%s.%N)
  code=$(podman inspect --format '{{.State.ExitCode}}' "$api")
  podman logs --timestamps --tail 8 "$api" >"$WORK/stop.log" 2>&1 || true
  sed 's/^/  api log: /' "$WORK/stop.log"
  [ "$code" != 137 ] || fail "the api was killed (exit 137), not stopped by SIGTERM"
  python - "$t0" "$t1" "$code" "$WORK/stop.log" <<'PY' || fail "the api's own shutdown took too long"
import datetime, sys
t0, t1, code, log = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
def when(line):  # podman's RFC 3339 timestamp with nanoseconds, the first field
    day, clock = line.split()[0].rstrip("Z").split("T")
    secs, _, frac = clock.partition(".")
    return datetime.datetime.fromisoformat(f"{day}T{secs}+00:00").timestamp() + float("0." + (frac or "0"))
lines = open(log, encoding="utf-8", errors="replace").read().splitlines()
start = next((when(x) for x in lines if "Shutting down" in x), None)
end = next((when(x) for x in lines if "Finished server process" in x), None)
own = None if start is None or end is None else end - start
print(f"api stopped on SIGTERM in {t1 - t0:.1f} s (its own shutdown {'?' if own is None else f'{own:.2f} s'}), exit code {code}")
sys.exit(own is None or own >= 5.0)
PY
}
check_graph_kept() {
  # The first start exported the CPU forward's ONNX graph into the onnx-cache volume; the api started again (as
  # after a crash or a restart) loads it from there instead of exporting it again.
  local api since
  api=$(container api)
  podman logs "$api" >"$WORK/first-start.log" 2>&1 || true  # to a file: grep -q would end podman early (pipefail)
  grep "ONNX graph" "$WORK/first-start.log" | sed 's/^/  api log: /'
  grep -q "ONNX graph exported to /cache/onnx/" "$WORK/first-start.log" \
    || fail "the first start did not export its ONNX graph into the onnx-cache volume"
  since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  podman start "$api" >/dev/null
  local i
  for i in $(seq 1 180); do
    curl -fsS "$API/readyz" >/dev/null 2>&1 && break
    sleep 1
  done
  podman logs --since "$since" "$api" >"$WORK/restart.log" 2>&1 || true
  grep "ONNX graph" "$WORK/restart.log" | sed 's/^/  api log: /'
  grep -q "ONNX graph loaded from /cache/onnx/" "$WORK/restart.log" \
    || fail "the api started again did not load its ONNX graph from the onnx-cache volume"
  predict >/dev/null || fail "the api started again does not answer"
}
check_down() {
  compose down -v >/dev/null
  local left
  left=$( { podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}'
            podman volume ls --format '{{.Name}}' | grep "^${PROJECT}_" || true
            podman network ls --format '{{.Name}}' | grep "^${PROJECT}_" || true; } )
  [ -z "$left" ] || fail "left behind after down -v: $left"
  echo "down -v: no container, volume or network of $PROJECT left"
}
step "check /readyz" check_ready
step "check /predict: the answer, contexts, a Redis cache hit on repeat" check_predict
step "check the api: uid 10001, read-only root filesystem" check_hardening
step "check the healthchecks (redis, api)" check_healthchecks
step "check that no command line holds the Redis password" check_no_password_on_a_command_line
step "check a Redis outage: /predict 200, /readyz degraded, recovery" check_redis_outage
if [ "${SMOKE_KEEP:-0}" != "1" ]; then
  step "stop the api: SIGTERM, no SIGKILL" check_stop
  step "start the api again: its ONNX graph loaded from the onnx-cache volume" check_graph_kept
  step "down -v leaves nothing behind" check_down
fi
echo "compose_smoke: all checks passed"
