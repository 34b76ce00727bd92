# Call C: the sampler's settings A/B'd in one call. Each setting has its own Triton cache, compiled in parallel
# first; then timed one at a time, interleaved twice (session 14: processes differ by 10-50% on rows no setting
# touches, so only a difference repeated in both rounds counts).
#   SPLIT_PREPARED=off: penalties / bias rows at <= 16 a step back in the wide shape (on: the split race)
#   PROCESSED_ONE_PASS=off: penalties / bias rows with no filters through the scratch row (on: one pass)
#   VOCAB_TABLE=off: the race's per-id hash computed for every value (on: read from a 256 KB table)
source .gpu/lib.sh
ab 520 "" "" "SPLIT_PREPARED=off" "PROCESSED_ONE_PASS=off" "VOCAB_TABLE=off"
for f in "$R"/ab-*.log; do echo "$f"; grep -E "greedy|T=1|top_p|top_k|min_p|penal|logprobs" "$f" | grep "σ=1"; done
pack
