# Call C: the sampler's switches A/B'd in one call. Each setting has its own Triton cache (a switch is a module
# constexpr), compiled in parallel first; then timed one at a time, interleaved (session 12's two processes
# differed by 12-16% on variants a switch does not touch).
source .gpu/lib.sh
SETTINGS=("" "LANE_BAND_ON=on" "RUNNERS_ON=off" "FILTER_MAX_REGISTERS=168" "FILTER_MAX_REGISTERS=128")
tag_of() { local t=${1:-defaults}; echo "${t//=/-}"; }
cache_of() { [ -z "$1" ] && echo "$PWD/.gpu/cache/triton" || echo "$PWD/.gpu/cache/triton-$(tag_of "$1")"; }
for s in "${SETTINGS[@]}"; do
  TRITON_CACHE_DIR=$(cache_of "$s") timeout 300 python3 .gpu/switch_ab.py --compile-only $s > "$R/compile-$(tag_of "$s").log" 2>&1 &
done
wait; echo "== compiled t=$(( $(date +%s) - T0 ))s"; tail -qn1 "$R"/compile-*.log
for s in "${SETTINGS[@]}" "" "LANE_BAND_ON=on" "FILTER_MAX_REGISTERS=168"; do
  TRITON_CACHE_DIR=$(cache_of "$s") step "ab-$(tag_of "$s")-$RANDOM" 100 python3 .gpu/switch_ab.py $s
done
for f in "$R"/ab-*.log; do echo "$f"; grep -E "top_p|top_k|min_p|T=1 \||penal|logprobs" "$f"; done
pack
