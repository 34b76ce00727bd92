source .gpu/lib.sh
for _ in $(seq 500); do pgrep -f "worker.cli bench" > /dev/null || break; sleep 2; done
cp .gpu/cache/m2/* "$R/"; tail -30 "$R/origin2.log"
cp -r .gpu/cache/data-8000/logs "$R/logs" 2>/dev/null
down
