#!/usr/bin/env bash
# Next GPU session: the draft-goodput-pinned comparison again, with the probe's scaled budget (context-aware
# on every profiled context) and the full-batch warm-up; then the flat schedule for as long as time lasts.
#   setsid bash .gpu/s24.sh END_EPOCH </dev/null &
# Writes /tmp/r24 (decaying) and /tmp/r24/flat; touches /tmp/r24/DONE.
set -u
cd "$(dirname "$0")/.."
END=${1:?END_EPOCH}
R=/tmp/r24; mkdir -p "$R/arms" "$R/flat"
exec >"$R/driver.log" 2>&1
echo "start $(date -u +%FT%T) end $(date -u -d @"$END" +%T)"
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
T=$(ls profiles/h200/qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__*.parquet | head -1)
cp "$T" "$R/arms/"; cp "$T" "$R/flat/"
arm() {  # arm NAME DIR SCHEDULE NEED_S SHARE_S
  local now; now=$(date +%s)
  if [ $(( END - now )) -lt "$4" ]; then echo "skip $1 ($3): $(( END - now )) s left"; return; fi
  echo "== arm $1 $3 $(date -u +%T) deadline +$5 s"
  PYTHONPATH=$PWD:${PYTHONPATH:-} python3 benchmarks/serving/serve_context.py arm "$1" \
    --table "$2/$(basename "$T")" --out "$2" --workloads ctx1k,ctx16k,mix --acceptance-rates "$3" \
    --waves 1 --policy strict --deadline-epoch $(( now + $5 ))
  echo "arm $1 rc=$?"; killgpu
}
arm draft-fixed "$R/arms" decaying 150 200
arm draft-aware-tail20-chunks-pinned "$R/arms" decaying 250 300
arm draft-stock-pinned "$R/arms" decaying 330 400
arm draft-stock-pinned-rerun "$R/arms" decaying 300 360
python3 benchmarks/serving/serve_context.py report --results "$R/arms"; echo "report rc=$?"
arm draft-fixed "$R/flat" flat 150 200
arm draft-aware-tail20-chunks-pinned "$R/flat" flat 250 300
arm draft-stock-pinned "$R/flat" flat 330 400
python3 benchmarks/serving/serve_context.py report --results "$R/flat"; echo "report rc=$?"
echo "done $(date -u +%FT%T)"; touch "$R/DONE"
#!/usr/bin/env bash
# After s24's stock arm: fixed and aware again (the compile cache now warm; aware under warn: its probe
# refused under strict on this host), then the stock rerun while time lasts.
set -u
cd "$(dirname "$0")/.."
END=${1:?END_EPOCH}
R=/tmp/r24
exec >"$R/driver25.log" 2>&1
until grep -q "arm draft-stock-pinned rc=" "$R/driver.log"; do sleep 2; done
pkill -f "s24.sh" ; sleep 1
echo "start $(date -u +%FT%T) end $(date -u -d @"$END" +%T)"
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
killgpu
T=$(ls "$R"/arms/qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__*.parquet | head -1)
mkdir -p "$R/strict-refused"; mv "$R"/arms/context-draft-aware-tail20-chunks-pinned* "$R"/arms/context-draft-fixed* "$R/strict-refused/"
arm() {  # arm NAME SCHEDULE POLICY NEED_S SHARE_S
  local now; now=$(date +%s)
  if [ $(( END - now )) -lt "$4" ]; then echo "skip $1 ($2): $(( END - now )) s left"; return; fi
  echo "== arm $1 $2 $3 $(date -u +%T) deadline +$5 s"
  PYTHONPATH=$PWD:${PYTHONPATH:-} python3 benchmarks/serving/serve_context.py arm "$1" \
    --table "$T" --out "$R/arms" --workloads ctx1k,ctx16k,mix --acceptance-rates "$2" \
    --waves 1 --policy "$3" --deadline-epoch $(( now + $5 ))
  echo "arm $1 rc=$?"; killgpu
}
arm draft-fixed decaying strict 150 170
arm draft-aware-tail20-chunks-pinned decaying warn 240 270
arm draft-stock-pinned-rerun decaying strict 290 $(( END - $(date +%s) - 5 ))
python3 benchmarks/serving/serve_context.py report --results "$R/arms"; echo "report rc=$?"
echo "done $(date -u +%FT%T)"; touch "$R/DONE"
#!/usr/bin/env bash
# Replaces s25's stock rerun with the fixed arm again (its 170 s share ended in the warm-up).
set -u
cd "$(dirname "$0")/.."
END=${1:?END_EPOCH}
R=/tmp/r24
exec >"$R/driver26.log" 2>&1
until grep -q "arm draft-aware-tail20-chunks-pinned rc=" "$R/driver25.log"; do sleep 0.5; done
pkill -f "s25.sh"; sleep 0.5; pkill -f "serve_context.py arm draft-stock-pinned-rerun"
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
killgpu
echo "start $(date -u +%FT%T) end $(date -u -d @"$END" +%T)"
T=$(ls "$R"/arms/qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__*.parquet | head -1)
mkdir -p "$R/fixed-cut"; mv "$R"/arms/context-draft-fixed* "$R/fixed-cut/"
now=$(date +%s)
echo "== arm draft-fixed decaying $(date -u +%T) deadline +$(( END - now - 3 )) s"
PYTHONPATH=$PWD:${PYTHONPATH:-} python3 benchmarks/serving/serve_context.py arm draft-fixed \
  --table "$T" --out "$R/arms" --workloads ctx1k,ctx16k,mix --acceptance-rates decaying \
  --waves 1 --policy strict --deadline-epoch $(( END - 3 ))
echo "arm draft-fixed rc=$?"; killgpu
python3 benchmarks/serving/serve_context.py report --results "$R/arms"; echo "report rc=$?"
echo "done $(date -u +%FT%T)"; touch "$R/DONE"
# the fixed rerun: serve_context.py arm draft-fixed --rerun (same flags as s26), then tar
