# Call 2: one stream through the engine loop (the one-slot fix, its TTFT), engine-only vs served at 1,024 streams.
source .gpu/lib.sh
model
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
step one 150 python3 -m engine.bench --device cuda --serve --shapes 1.5b --concurrency 1 --out "$R/one.md"
tail -30 "$R/one.md"
step engine-only 200 $GAGGLE bench --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 \
  --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/engine-only.json"
tail -25 "$R/engine-only.log"
up 8000 --worker-arg=--max-num-seqs=1024 --api-workers 4 && \
step served 200 $GAGGLE bench --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/served.json" \
  --compare "$R/engine-only.json"
tail -30 "$R/served.log"
down
