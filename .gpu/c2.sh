# Call C2 (if time is left): the filter variants under a register cap (more programs an SM against spills),
# interleaved with the defaults.
source .gpu/lib.sh
for setting in "FILTER_MAX_REGISTERS=168" "FILTER_MAX_REGISTERS=128" "" "FILTER_MAX_REGISTERS=168"; do
  tag=${setting:-defaults}; tag=${tag//=/-}
  cache=$PWD/.gpu/cache/triton; [ -n "$setting" ] && cache=$cache-$tag
  TRITON_CACHE_DIR=$cache step "ab-$tag-$RANDOM" 150 python3 .gpu/switch_ab.py $setting
done
for f in "$R"/ab-*.log; do echo "$f"; grep -E "top_p|top_k|min_p|T=1 \||penal|logprobs" "$f"; done
