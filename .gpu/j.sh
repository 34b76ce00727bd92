# Call J (after i.sh, warm cache): the 256-stream load with a larger prefill chunk beside decodes (a closed loop's
# first wave is 256 x 128 = 32,768 prompt tokens: at the default 2,048 a step it takes 16 steps), served and
# engine-only, to see how much of the 256-stream TTFT is the prefill cap.
source .gpu/lib.sh
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
L="--num-prompts 1024 --max-concurrency 256"
up 8000 --worker-arg=--max-num-seqs=1024 --worker-arg=--min-prefill-chunk=8192 --api-workers 4 || exit 1
step s256-chunk8192 100 $GAGGLE bench $L $W --save-detailed --save-result "$R/s256-chunk8192.json"
grep -E "Output token throughput|TTFT|ITL" "$R/s256-chunk8192.log" | grep -v Mean
step breakdown 60 python3 -m worker.loadgen.breakdown "$R/s256-chunk8192.json" .gpu/cache/data-8000/logs
tail -10 "$R/breakdown.log"
down
step engine-only-chunk8192 200 $GAGGLE bench --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 \
  --min-prefill-chunk 8192 $L $W --save-result "$R/engine-only-chunk8192.json"
grep -E "Output token throughput|TTFT|ITL" "$R/engine-only-chunk8192.log" | grep -v Mean
pack
