#!/usr/bin/env bash
# The designed experiment of issue 22 (decided before measuring): the in-engine A/B (one engine started stock,
# turns stock, table, table, stock) at the low schedule on ctx1k-c32 and ctx4k-c32, where advise predicts stock
# 4.3 / 4.4 % behind context-aware; fixed K=7 at low; then the A/B at decaying ctx1k (decisions equal there:
# the in-engine noise) while time lasts.
#   setsid bash .gpu/s27.sh END_EPOCH </dev/null &
# Writes /tmp/r27/low and /tmp/r27/decaying; touches /tmp/r27/DONE.
set -u
cd "$(dirname "$0")/.."
END=${1:?END_EPOCH}
R=/tmp/r27; mkdir -p "$R/low" "$R/decaying"
exec >"$R/driver.log" 2>&1
echo "start $(date -u +%FT%T) end $(date -u -d @"$END" +%T) host $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
git log -1 --format='checkout %h' 2>/dev/null || true
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
T=$(ls profiles/h200/qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__*.parquet | head -1)
cp "$T" "$R/low/"; cp "$T" "$R/decaying/"
arm() {  # arm NAME DIR SCHEDULE WORKLOADS WAVES NEED_S SHARE_S
  local now; now=$(date +%s)
  if [ $(( END - now )) -lt "$6" ]; then echo "skip $1 ($3): $(( END - now )) s left"; return; fi
  local share=$7; [ $(( now + share )) -gt "$END" ] && share=$(( END - now - 3 ))
  echo "== arm $1 $3 $4 waves $5 $(date -u +%T) deadline +$share s"
  PYTHONPATH=$PWD:${PYTHONPATH:-} python3 benchmarks/serving/serve_context.py arm "$1" \
    --table "$2/$(basename "$T")" --out "$2" --workloads "$4" --acceptance-rates "$3" \
    --waves "$5" --policy warn --deadline-epoch $(( now + share ))
  echo "arm $1 rc=$? $(date -u +%T)"; killgpu
}
arm draft-ab-tail20-chunks-noobs-pinned "$R/low" low ctx1k-c32,ctx4k-c32 3 600 850
arm draft-fixed "$R/low" low ctx1k-c32,ctx4k-c32 3 150 220
python3 benchmarks/serving/serve_context.py report --results "$R/low"; echo "report rc=$?"
arm draft-ab-tail20-chunks-noobs-pinned "$R/decaying" decaying ctx1k 1 330 420
python3 benchmarks/serving/serve_context.py report --results "$R/decaying"; echo "report rc=$?"
echo "done $(date -u +%FT%T)"; touch "$R/DONE"
