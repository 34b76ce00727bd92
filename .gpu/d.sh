# Call D (if time is left): the GPU tests session 12 did not run.
source .gpu/lib.sh
step pytest-d 500 python3 -u -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda.py \
  -k 'constrained or never_wait or distribution or sampler_warm_up or batched_admission or warm_up_leaves'
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-d.log" | tail -20
pack
