# Call S: session 19's second sampler A/B on the device's time (`--graphed`), c.sh's method (compiled in parallel,
# timed interleaved twice), against the new defaults (session 18's six candidates on since q.sh):
#   ARITH = FAST_EXP=on CHEAP_SKIP=on WIDE_RUNNER_PROBE=on: ex2.approx.ftz for e^x (no fix-up below 2^-126), the
#     race's skip test on the hash (no uniform a value), the runners' probe pass a whole block a chunk
#   + UNMASKED=on: the vocabulary size a constant and unmasked loads where it is a multiple of the chunk (216
#     registers: two programs an SM for the filter variant)
#   + FILTER_MAX_REGISTERS=168: the same capped at three programs an SM (spills in a row's set-up only)
# then the GPU sampler tests with ARITH + UNMASKED (bit-for-bit batch invariance, the sorted oracle, no sync).
source .gpu/lib.sh
ARITH="FAST_EXP=on CHEAP_SKIP=on WIDE_RUNNER_PROBE=on"
ab 400 --graphed "" "$ARITH" "$ARITH UNMASKED=on" "$ARITH UNMASKED=on FILTER_MAX_REGISTERS=168"
for f in "$R"/ab-*.log; do echo "$f"; grep -E "^\| " "$f" | grep -v -- "---"; done
if before 470; then
  TRITON_CACHE_DIR=$(cache_of "$ARITH UNMASKED=on") step pytest-new $(( 585 - ($(date +%s) - T0) )) python3 -c "
import sys; sys.path.insert(0, '.gpu'); from switch_ab import apply; apply('$ARITH UNMASKED=on'.split()); import pytest
sys.exit(pytest.main(['-m', 'gpu', '-v', '-p', 'no:cacheprovider', 'tests/test_cuda.py', '-k',
                      'picks_the_torch_path or distribution_matches or deterministic_and_batch_invariant or exact_rows '
                      'or never_synchronises or sampler_warm_up or plain_greedy']))"
  grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-new.log" | tail -20
fi
pack
