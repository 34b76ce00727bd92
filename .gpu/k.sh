# Call K (right after i.sh, warm Triton cache): just-in-time launch (`--launch just-in-time`, engine/device_timeline.py)
# against i.sh's early launch on the same loads: issue 13's 256-stream closed loop twice (TTFT by wave: the later
# waves are the steady state, where a finished request's replacement should start a step sooner), then the
# 1,024-stream load (its met throughput target must hold: i.sh's s1024-early is the comparison). Flip the default
# (WorkerConfig.launch, the CLI's --launch) only if the 256-stream TTFT gains and 1,024 streams lose nothing.
source .gpu/lib.sh
model
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
L="--num-prompts 1024 --max-concurrency 256"
up 8000 --worker-arg=--max-num-seqs=1024 --worker-arg=--launch=just-in-time --api-workers 4 || exit 1
for run in 1 2; do
  bench s256-jit-$run 100 $L $W --save-detailed
done
step breakdown 60 python3 -m worker.loadgen.breakdown "$R/s256-jit-2.json" .gpu/cache/data-8000/logs
tail -20 "$R/breakdown.log"
bench s1024-jit 150 --num-prompts 4096 --max-concurrency 1024 $W
grep '"loop stats"' .gpu/cache/data-8000/logs/worker-*.log > "$R/loopstats.log"
tail -4 "$R/loopstats.log" | cut -c1-600
down
pack
