# Call G (right after f.sh: the Triton cache is warm): the GC change A/B'd served (CPython's default young
# threshold 700 in the worker and the API, against 50,000, interleaved), then engine-only on the same workload.
source .gpu/lib.sh
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
i=0
for t in 700 50000 700; do
  i=$((i + 1))
  GAGGLE_GC_YOUNG_THRESHOLD=$t up 8000 --worker-arg=--max-num-seqs=1024 --worker-arg=--gc-young-threshold=$t \
    --api-workers 4 || exit 1
  step served-$i-gc$t 100 $GAGGLE bench --num-prompts 4096 --max-concurrency 1024 $W \
    --save-result "$R/served-$i-gc$t.json"
  grep '"loop stats"' .gpu/cache/data-8000/logs/worker-*.log > "$R/loopstats-$i-gc$t.log"
  down
done
for f in "$R"/served-*-gc*.log; do echo "$f"; sed -n 9p "$f"; sed -n 13p "$f"; sed -n 23p "$f"; done
step engine-only 200 $GAGGLE bench --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 \
  --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/engine-only.json"
sed -n 9p "$R/engine-only.log"; sed -n 21,23p "$R/engine-only.log"
pack
