#!/usr/bin/env bash
# Pricing with a drafter whose time holds still: vLLM's EAGLE-3 and DFlash speculators draft through
# CUDA graphs, where the draft-model speculator launches every draft step eagerly, so its pace
# follows the host and moves a turn's throughput by more than a pricing does.
#   1. profile the speculator's engine (its drafter config from arms.json's speculators, on
#      Qwen3-8B) at 1024 / 8192 / 16384 -> OUT/SPEC.parquet
#   2. `dspark-calib advise` on it at each schedule served, 1 to 256 requests at 1024 / 4096 /
#      8192 / 16384, written before anything is served -> OUT/advise-SCHEDULE.{json,txt}
#   3. (STRICT=1) the table loaded at engine start under --policy strict (load and probe lines,
#      observe on every step) on the first workload at the first schedule -> OUT/arms-strict; the
#      in-engine A/B (one engine started stock serves each workload under vLLM's pricing and the
#      table's in turn) at each schedule of AB_SCHEDULES and fixed K=7 (adaptive verification off)
#      at each of FIXED_SCHEDULES -> OUT/arms-SCHEDULE; the report of each folder
# Usage, from the repository root on a GPU host where `pip install '.[vllm]'` is done:
#   bash benchmarks/proofs/speculator_ab.sh SPEC OUT END_EPOCH      SPEC: eagle3 or dflash
# Settings (env): TABLE=path skips step 1 and serves that table (e.g. the shipped one);
# WORKLOADS (default ctx1k-c32,ctx4k-c32: cells chosen in advance from advise); AB_SCHEDULES and
# FIXED_SCHEDULES (arms.json schedule names, default decaying each; empty: none); STRICT (default 1).
# Every arm is skipped when too little time is left before END_EPOCH.
set -u
spec=${1:?usage: speculator_ab.sh SPEC OUT END_EPOCH}; out=${2:?OUT}; end=${3:?END_EPOCH}
read -r method draft < <(python3 -c "import json, sys; s = json.load(open('benchmarks/serving/arms.json'))['speculators']
if sys.argv[1] not in s or sys.argv[1] in ('dspark', 'draft'): sys.exit(f'{sys.argv[1]}: not a graphed speculator of arms.json')
print(s[sys.argv[1]]['method'], s[sys.argv[1]]['draft'])" "$spec") || exit 2
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
left() { echo $(( end - $(date +%s) )); }
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
{ date -u; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; } 2>&1
workloads=${WORKLOADS:-ctx1k-c32,ctx4k-c32}
ab_schedules=${AB_SCHEDULES-decaying}; fixed_schedules=${FIXED_SCHEDULES-decaying}
schedules=$(printf '%s\n' ${ab_schedules//,/ } ${fixed_schedules//,/ } | awk '!seen[$0]++' | paste -sd, -)
first=${ab_schedules%%,*}; first=${first:-${fixed_schedules%%,*}}
# the arms' shares, kept back from the profile: an arm's engine child stops 65 s before its
# deadline (serve_context.py's KILL_MARGIN_S), and an engine started stock runs vLLM's own
# start-up profile first
# the strict arm's engine is the host's first and compiles cold: its share covers that start, the
# kill margin and the first workload
ab_share=${AB_SHARE:-420}; fixed_share=${FIXED_SHARE:-260}; strict_share=${STRICT_SHARE:-300}
table=$out/$spec.parquet
if [ -n "${TABLE:-}" ]; then
  cp "$TABLE" "$table" || exit 2
  echo "== table $TABLE (not profiled here)"
else
  budget=$(( $(left) - ab_share - fixed_share ))
  if [ "$budget" -lt 240 ]; then echo "only $(left) s left: no time to profile and serve"; exit 1; fi
  echo "== profile $spec ($method, $draft) $(date -u +%T), at most $budget s"
  METHOD=$method DRAFT=$draft OUT="$out" timeout -k 10 "$budget" \
    bash benchmarks/proofs/profile.sh "$spec" --tp 1 --context-len 1024 --context-len 8192 --context-len 16384 \
    --replays 10 --max-model-len 32768
  echo "profile rc=$? $(date -u +%T)"; killgpu
fi
[ -f "$table" ] || { echo "no table: stop"; exit 1; }
"$py" -m dspark_calib inspect "$table" | head -30
for sched in ${schedules//,/ }; do
  rates=$("$py" -c "import json, sys; print(','.join(map(str, json.load(open('benchmarks/serving/arms.json'))['schedules'][sys.argv[1]])))" "$sched") || exit 2
  "$py" -m dspark_calib advise "$table" --acceptance "$rates" --context 1024 --context 4096 --context 8192 \
    --context 16384 --json > "$out/advise-$sched.json"
  "$py" -m dspark_calib advise "$table" --acceptance "$rates" --context 1024 --context 4096 --context 8192 \
    --context 16384 > "$out/advise-$sched.txt" 2>&1
  tail -3 "$out/advise-$sched.txt"
done
arm() {  # arm NAME NEED_S SHARE_S DIR SCHEDULE WORKLOADS [serve_context options]
  if [ "$(left)" -lt "$2" ]; then echo "skip $1 ($5): $(left) s left"; return; fi
  local name=$1 share=$3 dir=$4 sched=$5 wl=$6; shift 6
  [ "$share" -gt "$(( $(left) - 5 ))" ] && share=$(( $(left) - 5 ))
  mkdir -p "$dir"; cp "$table" "$dir/"
  echo "== arm $name ($sched) $(date -u +%T), at most $share s"
  "$py" benchmarks/serving/serve_context.py arm "$name" --table "$dir/$spec.parquet" --out "$dir" \
    --workloads "$wl" --acceptance-rates "$sched" --waves 2 "$@" --deadline-epoch $(( $(date +%s) + share ))
  echo "arm $name rc=$? $(date -u +%T)"; killgpu
}
if [ "${STRICT:-1}" = 1 ] && [ -n "$first" ]; then
  arm "$spec-aware-tail20-chunks-pinned" 260 "$strict_share" "$out/arms-strict" "$first" "${workloads%%,*}" \
    --policy strict
fi
for sched in ${ab_schedules//,/ }; do
  arm "$spec-ab-tail20-chunks-noobs-pinned" 360 "$ab_share" "$out/arms-$sched" "$sched" "$workloads" --policy warn
done
for sched in ${fixed_schedules//,/ }; do
  arm "$spec-fixed" 220 "$fixed_share" "$out/arms-$sched" "$sched" "$workloads" --policy warn
done
for d in "$out"/arms*; do
  "$py" benchmarks/serving/serve_context.py report --results "$d"; echo "report $d rc=$?"
done
