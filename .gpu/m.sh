# (RUNNING_FLOOR was removed after this call measured no gain: the script ran at commit ad19bf3)
# Call M: session 18's two sampler changes A/B'd (c.sh's method: each setting compiled in its own Triton cache in
# parallel, then timed one at a time, interleaved twice), then the sampler's GPU tests of the filter and logprobs
# rows (the kernel against its torch twin, the distribution, determinism and batch invariance).
#   RUNNING_FLOOR=off: min_p rows race over every value (on: over what min_p's floor under the running max keeps)
#   LOGPROBS_LANE_BAND=off: logprobs' raw top-k by a block-wide insert every chunk (on: each lane's largest two)
source .gpu/lib.sh
ab 420 "" "" "RUNNING_FLOOR=off" "LOGPROBS_LANE_BAND=off"
for f in "$R"/ab-*.log; do echo "$f"; grep -E "T=1 |top_p|min_p|logprobs" "$f"; done
if before 430; then
  step pytest-m $(( 590 - ($(date +%s) - T0) )) python3 -u -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda.py \
    -k 'picks_the_torch_path or distribution_matches or deterministic_and_batch_invariant'
  grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-m.log" | tail -12
fi
pack
