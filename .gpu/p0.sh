# Call 1: the new sampler paths and the one-slot fix on a GPU, the sampler table, the runners-up A/B.
source .gpu/lib.sh
nvidia-smi --query-gpu=name,memory.used --format=csv > "$R/gpu.txt"
step pytest-a 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda.py \
  -k 'sampler or sample_device or exact_rows or one_slot or engine_generates or argmax or admission'
tail -5 "$R/pytest-a.log"
step sampler 150 python3 -m engine.bench --device cuda --sampler-only --out "$R/sampler.md"
tail -22 "$R/sampler.md"
TRITON_CACHE_DIR=$PWD/.gpu/cache/triton-runners step runners-on 150 python3 .gpu/runners_ab.py on
tail -20 "$R/runners-on.log"
