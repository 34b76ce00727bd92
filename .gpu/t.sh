# Call T: the sampler's table on the device's time with session 19's defaults (session 18's six settings and
# FAST_EXP, CHEAP_SKIP, WIDE_RUNNER_PROBE on), issue 12 item 2's command, twice (the second warm); between them the
# GPU sampler tests (the sorted oracle, bit-for-bit batch invariance, every launch shape, no sync, warm-up).
source .gpu/lib.sh
step sampler-graphed-1 360 python3 -m engine.bench --device cuda --sampler-only --sampler-graphed --out -
grep -E "^\|" "$R/sampler-graphed-1.log"
if before 420; then
  step pytest-sampler 120 python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda.py -k \
    'picks_the_torch_path or distribution_matches or deterministic_and_batch_invariant or exact_rows or never_synchronises or sampler_warm_up or plain_greedy'
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$R/pytest-sampler.log" | tail -16
fi
if before 480; then
  step sampler-graphed-2 100 python3 -m engine.bench --device cuda --sampler-only --sampler-graphed --out -
  grep -E "^\|" "$R/sampler-graphed-2.log"
fi
pack
