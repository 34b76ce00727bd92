# Call I (first of a lease: a cold `gaggle up`): issue 13's 256-stream target (TTFT p50 <= 50 / p99 <= 250 ms, ITL
# p50 <= 10), served twice with the TTFT breakdown (and by wave) and the worker's loop stats, the 1,024-stream load
# once (early launch, the default: k.sh's A/B), then engine-only on the 256-stream load.
source .gpu/lib.sh
model
up 8000 --worker-arg=--max-num-seqs=1024 --api-workers 4 || exit 1
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
L="--num-prompts 1024 --max-concurrency 256"
for run in 1 2; do
  bench s256-$run 100 $L $W --save-detailed
done
step breakdown 60 python3 -m worker.loadgen.breakdown "$R/s256-2.json" .gpu/cache/data-8000/logs
tail -20 "$R/breakdown.log"
# the 1,024-stream load on the same service: k.sh runs it under just-in-time launch
bench s1024-early 150 --num-prompts 4096 --max-concurrency 1024 $W
grep '"loop stats"' .gpu/cache/data-8000/logs/worker-*.log > "$R/loopstats.log"
tail -3 "$R/loopstats.log" | cut -c1-500
down
before 400 || { echo "== engine-only skipped (t=$(( $(date +%s) - T0 ))s)"; pack; exit 0; }
bench engine-only 150 --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 $L $W --save-detailed
step waves-engine-only 60 python3 -m worker.loadgen.breakdown "$R/engine-only.json"
tail -8 "$R/waves-engine-only.log"
pack
