# Call Q: session 18's candidate sampler settings A/B'd on the device's time (each step replayed from a CUDA graph,
# the column that counts; launched beside it), c.sh's method: compiled in parallel, timed interleaved twice.
#   LAZY_MOMENTS=on: the filter rows' stats pass without sum / sum of squares / minimum (a pass of their own when
#     a search needs them)
#   BAND_VARIANTS=on LAZY_MOMENTS=on: and no lane band in steps without top_k rows (243 -> 168 registers, ptxas)
#   ONE_LOAD=on: logprobs rows read each value once where the variant has no processed row
source .gpu/lib.sh
SETTINGS=("" "LAZY_MOMENTS=on" "BAND_VARIANTS=on LAZY_MOMENTS=on" "ONE_LOAD=on")
tag_of() { local t=${1:-defaults}; t=${t//=/-}; t=${t// /_}; echo "${t//,/-}"; }
cache_of() { [ -z "$1" ] && echo "$PWD/.gpu/cache/triton" || echo "$PWD/.gpu/cache/triton-$(tag_of "$1")"; }
for s in "${SETTINGS[@]}"; do
  TRITON_CACHE_DIR=$(cache_of "$s") timeout 330 python3 .gpu/switch_ab.py --compile-only $s > "$R/compile-$(tag_of "$s").log" 2>&1 &
done
wait; echo "== compiled t=$(( $(date +%s) - T0 ))s"; tail -qn1 "$R"/compile-*.log
for round in 1 2; do
  for s in "${SETTINGS[@]}"; do
    before 540 || break 2
    TRITON_CACHE_DIR=$(cache_of "$s") step "ab-$(tag_of "$s")-$round" 60 python3 .gpu/switch_ab.py --graphed $s
  done
done
for f in "$R"/ab-*.log; do echo "$f"; grep -E "top_p|top_k|min_p|logprobs" "$f"; done
pack
