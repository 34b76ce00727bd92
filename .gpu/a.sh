# Call A: the origin-notes workload at 2 requests/s, all 1,200 (600 s of arrivals: longer than one call, so the
# service and the client run in their own session; b.sh, called at once after, collects).
source .gpu/lib.sh
model
up 8000 --worker-arg=--max-num-seqs=1024 --api-workers 4 || exit 1
mkdir -p .gpu/cache/m2
setsid nohup $GAGGLE bench --num-prompts 1200 --request-rate 2 --input-len 512 --output-len 512 \
  --range-ratio 0.99 --ignore-eos --save-result .gpu/cache/m2/origin2.json > .gpu/cache/m2/origin2.log 2>&1 < /dev/null &
sleep $(( 570 - ($(date +%s) - T0) ))
tail -3 .gpu/cache/m2/origin2.log; echo "t=$(( $(date +%s) - T0 ))"
