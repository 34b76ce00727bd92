# Call F (first of a lease): a cold `gaggle up` (the warm-up's parts with the threaded sampler compile), then
# 1,024 streams served twice with the GC change, the worker's loop-stats lines kept and a py-spy profile of the
# worker during the second run (which thread holds the GIL: is the served step host-bound?).
source .gpu/lib.sh
model
up 8000 --worker-arg=--max-num-seqs=1024 --api-workers 4 || exit 1
WLOG=$(ls .gpu/cache/data-8000/logs/worker-*.log | head -1)
grep '"warm-up parts"\|"engine warmed up"' "$WLOG" | tee "$R/warmup.log"
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
step served1 100 $GAGGLE bench --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/served1.json"
sed -n 9,16p "$R/served1.log"; sed -n 21,23p "$R/served1.log"
WPID=$(pgrep -f "json worker --redis-url" | head -1)
(sleep 8; timeout 20 py-spy record -p "$WPID" -d 10 -r 100 -f raw -o "$R/worker-gil.raw" --gil > "$R/pyspy.log" 2>&1) &
PSPY=$!  # (a bare `wait` would also wait for gaggle up, a background job of this shell)
# each thread's CPU in the middle of the run (if py-spy may not attach here, this still says which is busy)
(sleep 12; top -H -b -d 2 -n 2 -p "$WPID" | awk '/^top -/{n++} n==2' > "$R/threads.log" 2>&1) &
TOPH=$!
step served2 100 $GAGGLE bench --num-prompts 4096 --max-concurrency 1024 $W --save-detailed \
  --save-result "$R/served2.json"
sed -n 9,16p "$R/served2.log"; sed -n 21,23p "$R/served2.log"
wait "$PSPY" "$TOPH"; sed -n 7,14p "$R/threads.log"
# TTFT part by part at 1,024 streams (the breakdown where a target is missed)
step breakdown 60 python3 -m worker.loadgen.breakdown "$R/served2.json" .gpu/cache/data-8000/logs
tail -12 "$R/breakdown.log"
grep '"loop stats"' "$WLOG" > "$R/loopstats.log"; tail -4 "$R/loopstats.log" | cut -c1-600
tail -2 "$R/pyspy.log"
down
