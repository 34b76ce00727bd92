# Call Q: session 18's candidate sampler settings (all off by default, exact either way) A/B'd on the device's time
# (each step replayed from a CUDA graph: the column that counts; launched beside it), c.sh's method: compiled in
# parallel, timed interleaved twice; then the GPU sampler tests with all of them on (batch invariance across the
# wide and small filter shapes, bit for bit, is the one the interpreter cannot check).
#   BAND_VARIANTS=on LAZY_MOMENTS=on: the filter rows' stats pass without sum / sum of squares / minimum (a pass of
#     their own when a search needs them), and no lane band in steps without top_k rows (243 -> 168 registers)
#   ONE_LOAD=on: logprobs rows read each value once where the variant has no processed row
#   RUNNER_MASSES=on: the top_p rows' runners' probe pass sums masses only (top_p alone never reads a count there)
#   FIXED_SUMS=on FILTER_WIDE=on: sums across lanes as int64 fixed point, and filter / logprobs steps of <= 16 rows
#     in one 16-warp program an SM (batch 1: top_p 0.12, logprobs 0.106 ms on one 4-warp program)
source .gpu/lib.sh
ALL="FIXED_SUMS=on FILTER_WIDE=on BAND_VARIANTS=on LAZY_MOMENTS=on ONE_LOAD=on RUNNER_MASSES=on"
ab 470 --graphed "" "BAND_VARIANTS=on LAZY_MOMENTS=on" "ONE_LOAD=on" "RUNNER_MASSES=on" "FIXED_SUMS=on FILTER_WIDE=on" "$ALL"
for f in "$R"/ab-*.log; do echo "$f"; grep -E "top_p|top_k|min_p|logprobs" "$f"; done
if before 480; then
  TRITON_CACHE_DIR=$(cache_of "$ALL") step pytest-all-on $(( 590 - ($(date +%s) - T0) )) python3 -c "
import sys; sys.path.insert(0, '.gpu'); from switch_ab import apply; apply('$ALL'.split()); import pytest
sys.exit(pytest.main(['-m', 'gpu', '-v', '-p', 'no:cacheprovider', 'tests/test_cuda.py', '-k',
                      'picks_the_torch_path or distribution_matches or deterministic_and_batch_invariant']))"
  grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-all-on.log" | tail -14
fi
pack
