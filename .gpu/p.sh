# Call P (short, the session's last device time): the sampler's table with each step also replayed from a CUDA
# graph: the device's time alone, against the same call launched from Python (batch 1's budget is 0.1 ms: how much
# of it is the host's launching?). Then the Triton cache's size (whether bring_cache can carry it).
source .gpu/lib.sh
step sampler-graphed 130 python3 -m engine.bench --device cuda --sampler-only --sampler-graphed --out -
cat "$R/sampler-graphed.log" | grep -E "^\|"
du -sh .gpu/cache/triton
