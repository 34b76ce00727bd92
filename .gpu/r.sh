# Call R (a cold `gaggle up`): issue 13's 256-stream closed loop with 4 API processes (what `gaggle up` picks on
# the 16-core host) against 8: session 18's breakdown put ~24 ms of the burst's TTFT p50 (p90 ~100) between the
# API's building a request and the worker's loop taking it, and 6 / 51 ms (p50 / p90) in the API before that, 64
# requests of a wave on each process (the breakdown now splits the first at the stream entry's time: the API's
# enqueue / Redis and the reader / the worker's inbox). Then the Triton cache packed to come back (bring_cache: a later session
# carries it and skips ~300 s of a cold start).
source .gpu/lib.sh
model
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
L="--num-prompts 1024 --max-concurrency 256"
for api in ${@:-4 8}; do  # `bash .gpu/r.sh 8`: 8 API processes only
  if [ "$api" != "${1:-4}" ]; then before 420 || break; fi
  up 8000 --worker-arg=--max-num-seqs=1024 --api-workers $api || break
  for run in 1 2; do
    bench s256-api$api-$run 100 $L $W --save-detailed
  done
  step breakdown-api$api 60 python3 -m worker.loadgen.breakdown "$R/s256-api$api-2.json" .gpu/cache/data-8000/logs
  head -40 "$R/breakdown-api$api.log" | grep -E "^\| (→|API|client|took|the|[0-9])"
  down
done
find "$R" -name '*.json' -size +1M -delete
pack
bring_cache
