# Call H: engine-only on session 14's workload (g.sh's failed: the threaded warm-up set_device("cuda")), then
# the sampler switches' A/B (c.sh) if the time allows.
source .gpu/lib.sh
model
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
step engine-only 400 $GAGGLE bench --engine-only --model .gpu/cache/m15.pth --max-num-seqs 1024 \
  --num-prompts 4096 --max-concurrency 1024 $W --save-result "$R/engine-only.json"
sed -n 9,16p "$R/engine-only.log"; sed -n 21,23p "$R/engine-only.log"; tail -3 "$R/engine-only.log"
pack
