# Call D: the GPU tests of what session 14 changed in the sampler (the lane band and runners-up always on, the
# split race and one pass for processed rows, the vocabulary's hash table, the warm-up), and the sampler's others.
# First of a lease: the sampler's variants compiled first by its threaded warm-up (tests compiling them one by one
# on a cold cache ran past a call's limit in session 12).
source .gpu/lib.sh
step compile 300 python3 .gpu/switch_ab.py --compile-only; tail -1 "$R/compile.log"
step pytest-d 450 python3 -u -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda.py \
  -k 'exact_rows or sampler or sample_device or batch_invariance or warm_up_leaves or greedy'
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-d.log" | tail -30
pack
