#!/usr/bin/env bash
# What one GPU lease carries, made here: the wheels the device's image lacks and the slice of ../shared that
# `python -m bench.gpu` reads, into .gpu/ (git-ignored through .git/info/exclude). The lease then runs
# `bash scripts/gpu_lease.sh` with `.gpu` carried (docs/performance.md, "GPU"). A call carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
PACK=.gpu
grep -qx "/$PACK/" .git/info/exclude 2>/dev/null || echo "/$PACK/" >>.git/info/exclude
rm -rf "$PACK" && mkdir -p "$PACK/whl" "$PACK/shared/data/wiki" "$PACK/shared/data/lama/TREx"

# The image has torch, transformers, numpy, scipy, onnxruntime, httpx, uvloop...; not these (pinned as the lock pins
# them; typing_extensions too, as new as pydantic_core needs).
lock() { grep -i "^$1==" requirements.lock | head -1; }
WHEELS=(faiss-cpu fastapi starlette pydantic pydantic_core pydantic-settings annotated-types typing-inspection uvicorn
        httptools websockets watchfiles python-dotenv sniffio redis mwparserfromhell pysbd stopwordsiso swagger-ui-py
        typing_extensions opentelemetry-api mmh3)
specs=()
for w in "${WHEELS[@]}"; do
  s=$(lock "$w") || { echo "gpu_pack: $w is not in requirements.lock" >&2; exit 1; }
  specs+=("$s")
done
platforms=()
for n in 17 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$PACK/whl" "${specs[@]}"

# ../shared, as much as bench.gpu reads: the tokenizer, the vital articles, LAMA's templates and each T-REx file's
# first 400 facts without their evidence sentences (bench.common.lama_queries reads no more: the subjects)
cp -r "$SHARED/data/tokenizer" "$PACK/shared/data/"
cp "$SHARED/data/wiki/vital_articles.jsonl" "$PACK/shared/data/wiki/"
cp "$SHARED/data/lama/relations.jsonl" "$PACK/shared/data/lama/"
python3 - "$SHARED/data/lama/TREx" "$PACK/shared/data/lama/TREx" <<'FACTS'
import json, pathlib, sys
source, pack = map(pathlib.Path, sys.argv[1:])
for path in sorted(source.glob("P*.jsonl")):
    facts = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[:400]]
    kept = [{k: fact[k] for k in ("sub_label", "obj_label", "uuid") if k in fact} for fact in facts]
    (pack / path.name).write_text("".join(json.dumps(f) + "\n" for f in kept), encoding="utf-8")
FACTS

# bench.serving's processes share a Redis cache (several workers) and the image has no redis-server: this machine's
# binary travels with the libraries the image lacks, behind a wrapper that gpu_lease.sh puts on PATH
mkdir -p "$PACK/redis/lib" "$PACK/redis/bin"
cp "$(readlink -f "$(command -v redis-server)")" "$PACK/redis/redis-server.bin"
for lib in liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" "$PACK/redis/lib/"; done
cat >"$PACK/redis/bin/redis-server" <<'WRAP'
#!/usr/bin/env bash
d="$(cd "$(dirname "$0")/.." && pwd)"
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/redis-server.bin" "$@"
WRAP
chmod +x "$PACK/redis/bin/redis-server"
"$PACK/redis/bin/redis-server" --version >/dev/null || { echo "gpu_pack: the carried redis-server does not run" >&2; exit 1; }

# the commit the lease runs, as bench.common.source_commit writes it: its copy of the tree is no git checkout, so
# gpu_lease.sh hands this to the results (BERT_KNN_SOURCE)
source=$(git rev-parse --short=12 HEAD)
[ -z "$(git status --porcelain --untracked-files=no -- . ':(exclude)bench/results')" ] || source="$source+changes"
echo "$source" >"$PACK/source"

total=$(( $(du -sb "$PACK" | cut -f1) + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) ))
echo "gpu_pack: $(ls "$PACK/whl" | wc -l) wheels; the call carries $((total / 1048576)) MiB with the tracked tree (limit 64)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "gpu_pack: over the 64 MiB a call carries" >&2; exit 1; }
