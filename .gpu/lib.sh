# Sourced by every .gpu/*.sh on the lent GPU host (run from the repo root).
# Installs the carried wheels, keeps the Triton cache between calls of one lease (.gpu/cache is git-ignored,
# so the device tool leaves it in place while the machine stays warm), writes every log under $R = $OUT.
set -uo pipefail
export R=${OUT:-/tmp/out}; mkdir -p "$R"
if [ ! -d /tmp/site/redis ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$R/pip.log" 2>&1 || { echo "pip failed"; tail "$R/pip.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=$PWD/.gpu/cache/triton TRITON_CACHE_AUTOTUNING=1
# a fresh machine starts from the Triton cache an earlier call brought back (bring_cache), when it was carried
# (`carry: [".whl", ".gpu/carry"]`): a cold `gaggle up` spent ~320 of its ~350 s compiling and autotuning
if [ ! -d "$TRITON_CACHE_DIR" ] && [ -f .gpu/carry/triton.tgz ]; then
  mkdir -p .gpu/cache && tar xzf .gpu/carry/triton.tgz -C .gpu/cache && echo "== Triton cache restored ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
fi
mkdir -p "$TRITON_CACHE_DIR"
GAGGLE="python3 -m worker.cli"
# preflight: every process gaggle up starts imports these (session 12 lost a call to an API crash-looping on a
# wheel missing here: .gpu/wheels.sh fetches them)
python3 -c "import api.main, worker.worker, worker.batch_cli, engine.engine" > "$R/imports.log" 2>&1 || {
  echo "imports fail on this host:"; tail -3 "$R/imports.log"; exit 1; }
T0=$(date +%s)
# step NAME LIMIT_S CMD...: runs CMD with a time limit, its output in $R/NAME.log (kept when cut), one line here
step() {
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s ))s (t=$(( $(date +%s) - T0 ))s)"
  return $rc
}
# bench NAME LIMIT_S ARGS...: gaggle bench with ARGS, its result in $R/NAME.json, its headline numbers here
bench() {
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" $GAGGLE bench "$@" --save-result "$R/$name.json"
  grep -E "Output token throughput|TTFT|ITL" "$R/$name.log" | grep -v Mean
}
model() {  # the 1.5B random bf16 model, once a lease
  [ -f .gpu/cache/m15.pth ] || $GAGGLE demo-model --preset 1.5b --out .gpu/cache/m15.pth > "$R/model.log" 2>&1
}
# up PORT ARGS...: gaggle up in its own session (survives the call), waits for /ready
up() {
  local port=$1; shift
  rm -rf .gpu/cache/data-$port; mkdir -p .gpu/cache/data-$port
  setsid nohup $GAGGLE up --model .gpu/cache/m15.pth --port "$port" --data-dir .gpu/cache/data-$port "$@" \
    > "$R/up-$port.log" 2>&1 < /dev/null &
  for _ in $(seq 600); do
    python3 -c "import sys,urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$port/ready" > /dev/null 2>&1 && { echo "== up $port ready t=$(( $(date +%s) - T0 ))s"; return 0; }
    grep -q "exited; restarting" "$R/up-$port.log" && { echo "== up $port: a child crashed"; tail -5 "$R/up-$port.log"
      tail -n 20 .gpu/cache/data-$port/logs/*.log; down; return 1; }
    sleep 1
  done
  echo "== up $port NOT ready"; tail -20 "$R/up-$port.log"; return 1
}
down() { pkill -INT -f "worker.cli up" ; sleep 8; pkill -9 -f "worker.cli" ; pkill -9 -f redis-server; true; }
# before SECONDS: true while the call has run less than that (a call is cut at 600 s, and a cut call brings back
# nothing packed): optional steps last, behind it
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
# pack: everything under $R in one archive (the device tool brings back only a few files a call)
pack() { (cd "$R" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz "$R/all.tgz"); }
# bring_cache: after pack, the Triton cache in pieces of 15 MiB ($OUT/triton.tgz.aa, .ab, ...: a file back is at most
# 16 MiB, 64 in all, and what travels at most 64 MiB with the wheels' ~23), when it is small enough; here:
# `cat DIR/triton.tgz.* > .gpu/carry/triton.tgz`, then carry .gpu/carry
bring_cache() {
  tar czf /tmp/triton.tgz -C .gpu/cache triton
  local mib=$(( $(stat -c %s /tmp/triton.tgz) / 1048576 ))
  echo "== Triton cache: $(du -sh .gpu/cache/triton | cut -f1) on disk, ${mib} MiB packed"
  [ "$mib" -lt 36 ] && split -b 15m /tmp/triton.tgz "$R/triton.tgz." || echo "== too large to bring back"
}
# ab GUARD FLAGS SETTING...: engine.cuda.sampling's settings A/B'd (each compiled in its own Triton cache, in
# parallel; then the sampler table timed one at a time, interleaved twice, while `before GUARD`: processes differ by
# 10-50% on rows no setting touches, so only a difference repeated in both rounds counts). FLAGS go to switch_ab.py
# ("" for none, --graphed); a SETTING is "NAME=VALUE ...", "" the defaults
tag_of() { local t=${1:-defaults}; t=${t//=on/}; t=${t//=/-}; t=${t// /+}; echo "${t//,/-}"; }
cache_of() { [ -z "$1" ] && echo "$PWD/.gpu/cache/triton" || echo "$PWD/.gpu/cache/triton-$(tag_of "$1")"; }
ab() {
  local guard=$1 flags=$2 s round; shift 2
  for s in "$@"; do
    TRITON_CACHE_DIR=$(cache_of "$s") timeout 330 python3 .gpu/switch_ab.py --compile-only $s \
      > "$R/compile-$(tag_of "$s").log" 2>&1 &
  done
  wait; echo "== compiled t=$(( $(date +%s) - T0 ))s"; tail -qn1 "$R"/compile-*.log
  for round in 1 2; do
    for s in "$@"; do
      before "$guard" || return 0
      TRITON_CACHE_DIR=$(cache_of "$s") step "ab-$(tag_of "$s")-$round" 100 python3 .gpu/switch_ab.py $flags $s
    done
  done
}
