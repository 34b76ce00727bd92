# Call D: the GPU tests of what session 14 changed in the sampler (the lane band and runners-up always on, the
# split race for processed rows, the warm-up), and the sampler's others.
source .gpu/lib.sh
step pytest-d 500 python3 -u -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda.py \
  -k 'exact_rows or sampler or sample_device or batch_invariance or warm_up_leaves or greedy'
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-d.log" | tail -30
pack
