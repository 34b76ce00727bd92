# Call C: the runners-up A/B in one call, interleaved (off, on, off, on: session 12's two processes differed by
# 12-16% on variants the switch does not touch), then the GPU tests not run in session 12.
source .gpu/lib.sh
for run in off on off on; do
  TRITON_CACHE_DIR=$PWD/.gpu/cache/triton-$run step runners-$run-$RANDOM 120 python3 .gpu/runners_ab.py $run
done
for f in "$R"/runners-*.log; do echo "$f"; grep -E "top_p|top_k|min_p|T=1 \|" "$f"; done
step pytest-c 300 python3 -u -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda.py \
  -k 'constrained or never_wait or distribution or sampler_warm_up or batched_admission or warm_up_leaves'
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$R/pytest-c.log" | tail -20
