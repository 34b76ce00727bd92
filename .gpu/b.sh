# Call B (right after a.sh): collect the origin run; then 1,024 streams served on the same service, and the same
# workload engine-only in-process, for the served / engine-only ratio of one call.
source .gpu/lib.sh
for _ in $(seq 300); do pgrep -f "worker.cli bench" > /dev/null || break; sleep 2; done
cp .gpu/cache/m2/* "$R/"; tail -30 "$R/origin2.log"
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
step served 200 $GAGGLE bench --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/served.json"
tail -22 "$R/served.log"
cp -r .gpu/cache/data-8000/logs "$R/logs" 2>/dev/null
down
step engine-only 200 $GAGGLE bench --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 \
  --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/engine-only.json" --compare "$R/served.json"
tail -30 "$R/engine-only.log"
