# (--gil-switch-ms was removed after this call measured no effect: the script ran at commit ad19bf3)
# Call L (first of a lease: a cold `gaggle up`): the worker's GIL switch interval, CPython's 5 ms against 0.5 ms
# (--gil-switch-ms), on issue 13's 256-stream closed loop and on Poisson arrivals (233/s, <= 256 in flight: where
# session 10 found the served path adding ~40 ms to the engine's 15), each with the TTFT breakdown, which now
# splits "→ a worker took it" at the reader's stamp (Redis and the reader's round trips / the loop's inbox).
source .gpu/lib.sh
model
W="--input-len 128 --output-len 256 --ignore-eos --temperature 1.0"
L="--num-prompts 1024 --max-concurrency 256"
P="--num-prompts 2048 --request-rate 233 --max-concurrency 256"
for gil in 5 0.5; do
  if [ "$gil" = 5 ]; then up 8000 --worker-arg=--max-num-seqs=1024 --api-workers 4 || exit 1
  else before 400 || break; up 8000 --worker-arg=--max-num-seqs=1024 --worker-arg=--gil-switch-ms=$gil --api-workers 4 || break; fi
  bench s256-gil$gil 100 $L $W --save-detailed
  step breakdown-s256-gil$gil 60 python3 -m worker.loadgen.breakdown "$R/s256-gil$gil.json" .gpu/cache/data-8000/logs
  head -40 "$R/breakdown-s256-gil$gil.log" | grep -E "^\| (→|API|client|took|the)"
  bench poisson-gil$gil 100 $P $W --save-detailed
  step breakdown-poisson-gil$gil 60 python3 -m worker.loadgen.breakdown "$R/poisson-gil$gil.json" .gpu/cache/data-8000/logs
  head -40 "$R/breakdown-poisson-gil$gil.log" | grep -E "^\| (→|API|client|took|the)"
  if [ "$gil" != 5 ] && before 500; then bench s1024-gil$gil 100 --num-prompts 4096 --max-concurrency 1024 $W; fi
  grep '"loop stats"' .gpu/cache/data-8000/logs/worker-*.log | tail -2 | cut -c1-420 > "$R/loopstats-gil$gil.log"
  down
done
find "$R" -name '*.json' -size +1M -delete  # the detailed results: only the breakdowns come back
pack
