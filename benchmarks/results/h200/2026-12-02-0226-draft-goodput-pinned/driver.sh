#!/usr/bin/env bash
# Next GPU session: the draft-goodput-pinned comparison (issue: goodput proof), detached (setsid).
#   setsid bash .gpu/s23.sh END_EPOCH [WAVES] </dev/null &
# Arms in order: draft-stock-pinned, draft-fixed, draft-aware-tail20-chunks-pinned (policy strict: the load and
# probe lines of the shipped table), draft-stock-pinned-rerun; workloads ctx1k,ctx16k,mix; decaying schedule.
set -u
cd "$(dirname "$0")/.."
END=${1:?END_EPOCH}; WAVES=${2:-1}
R=/tmp/r23; mkdir -p "$R/arms"
exec >"$R/driver.log" 2>&1
echo "start $(date -u +%FT%T) end $(date -u -d @"$END" +%T) waves $WAVES"
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
T=$(ls profiles/h200/qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__*.parquet | head -1)
cp "$T" "$R/arms/"
n=0
for arm in draft-stock-pinned draft-fixed draft-aware-tail20-chunks-pinned draft-stock-pinned-rerun; do
  n=$((n + 1)); now=$(date +%s); left=$(( END - now )); share=$(( left / (5 - n) ))
  [ "$share" -gt 560 ] && share=560
  if [ "$share" -lt 240 ]; then echo "skip $arm: $left s left"; continue; fi
  echo "== arm $arm $(date -u +%T) deadline +$share s"
  PYTHONPATH=$PWD:${PYTHONPATH:-} python3 benchmarks/serving/serve_context.py arm "$arm" \
    --table "$R/arms/$(basename "$T")" --out "$R/arms" --workloads ctx1k,ctx16k,mix --acceptance-rates decaying \
    --waves "$WAVES" --policy strict --deadline-epoch $(( now + share ))
  echo "arm $arm rc=$?"
  killgpu
done
python3 benchmarks/serving/serve_context.py report --results "$R/arms"; echo "report rc=$?"
echo "done $(date -u +%FT%T)"; touch "$R/DONE"
