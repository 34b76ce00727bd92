# Call C: the sampler's switches A/B'd in one call, interleaved (session 12's two processes differed by 12-16%
# on variants a switch does not touch): defaults, lane band on, runners-up off, defaults, lane band on.
source .gpu/lib.sh
for setting in "" "LANE_BAND_ON=on" "RUNNERS_ON=off" "" "LANE_BAND_ON=on"; do
  tag=${setting:-defaults}; tag=${tag//=/-}
  cache=$PWD/.gpu/cache/triton; [ -n "$setting" ] && cache=$cache-$tag
  TRITON_CACHE_DIR=$cache step "ab-$tag-$RANDOM" 150 python3 .gpu/switch_ab.py $setting
done
for f in "$R"/ab-*.log; do echo "$f"; grep -E "top_p|top_k|min_p|T=1 \|" "$f"; done
