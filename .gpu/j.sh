# Call J (after i.sh, warm cache): the 256-stream load with other prefill chunks beside decodes (a closed loop's
# first wave is 256 x 128 = 32,768 prompt tokens: 16 steps at the default 2,048). On the synthetic engine (BENCHMARKS,
# session 14) a chunk of 512 halved engine-only's TTFT p50 but not the served one's; 8,192 did the reverse for p99.
source .gpu/lib.sh
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
L="--num-prompts 1024 --max-concurrency 256"
up 8000 --worker-arg=--max-num-seqs=1024 --worker-arg=--min-prefill-chunk=512 --api-workers 4 || exit 1
bench s256-chunk512 100 $L $W --save-detailed
step breakdown 60 python3 -m worker.loadgen.breakdown "$R/s256-chunk512.json" .gpu/cache/data-8000/logs
tail -8 "$R/breakdown.log"
down
for chunk in 512 8192; do
  bench engine-only-chunk$chunk 150 --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 \
    --min-prefill-chunk $chunk $L $W
done
pack
