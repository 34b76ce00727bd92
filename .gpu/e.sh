# Call E (if time is left): a lone stream's TTFT by the engine's slot count (4-5 ms with one slot, 15 ms with
# 1,024 in session 10), with the launch / wait split of the steps before its first token.
source .gpu/lib.sh
for n in 1 64 256 1024; do
  step ttft-$n 150 python3 -m engine.bench --device cuda --serve --shapes 1.5b --concurrency $n \
    --workload "1 stream" --out "$R/ttft-$n.md"
  grep "1 stream" "$R/ttft-$n.md"
done
pack
