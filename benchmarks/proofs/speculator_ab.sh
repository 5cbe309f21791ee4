#!/usr/bin/env bash
# Pricing with a drafter whose time holds still: vLLM's EAGLE-3 and DFlash speculators draft through
# CUDA graphs, where the draft-model speculator launches every draft step eagerly, so its pace
# follows the host and moves a turn's throughput by more than a pricing does.
#   1. profile the speculator's engine (its drafter config from arms.json's speculators, on
#      Qwen3-8B) at 1024 / 8192 / 16384 -> OUT/SPEC.parquet
#   2. `dspark-calib advise` on it at the decaying schedule, 1 to 256 requests at 1024 / 4096 /
#      16384, written before anything is served -> OUT/advise-decaying.{json,txt}
#   3. the in-engine A/B (one engine started stock serves each workload under vLLM's pricing and
#      the table's in turn) and fixed K=7, both at the decaying schedule on ctx1k-c32 and
#      ctx4k-c32, the cells fixed here in advance -> OUT/arms, then the report
# Usage, from the repository root on a GPU host where `pip install '.[vllm]'` is done:
#   bash benchmarks/proofs/speculator_ab.sh SPEC OUT END_EPOCH      SPEC: eagle3 or dflash
set -u
spec=${1:?usage: speculator_ab.sh SPEC OUT END_EPOCH}; out=${2:?OUT}; end=${3:?END_EPOCH}
read -r method draft < <(python3 -c "import json, sys; s = json.load(open('benchmarks/serving/arms.json'))['speculators']
if sys.argv[1] not in s or sys.argv[1] in ('dspark', 'draft'): sys.exit(f'{sys.argv[1]}: not a graphed speculator of arms.json')
print(s[sys.argv[1]]['method'], s[sys.argv[1]]['draft'])" "$spec") || exit 2
mkdir -p "$out/arms"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
left() { echo $(( end - $(date +%s) )); }
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
{ date -u; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; } 2>&1
# the arms' shares, kept back from the profile: an arm's engine child stops 65 s before its
# deadline (serve_context.py's KILL_MARGIN_S), and an engine started stock runs vLLM's own
# start-up profile first
ab_share=420; fixed_share=260
budget=$(( $(left) - ab_share - fixed_share ))
if [ "$budget" -lt 240 ]; then echo "only $(left) s left: no time to profile and serve"; exit 1; fi
echo "== profile $spec ($method, $draft) $(date -u +%T), at most $budget s"
METHOD=$method DRAFT=$draft OUT="$out" timeout -k 10 "$budget" \
  bash benchmarks/proofs/profile.sh "$spec" --tp 1 --context-len 1024 --context-len 8192 --context-len 16384 \
  --replays 10 --max-model-len 32768
echo "profile rc=$? $(date -u +%T)"; killgpu
table=$out/$spec.parquet
[ -f "$table" ] || { echo "no table: stop"; exit 1; }
"$py" -m dspark_calib inspect "$table" | head -30
"$py" -m dspark_calib advise "$table" --acceptance 0.9,0.8,0.7,0.55,0.4,0.3,0.2 --context 1024 --context 4096 \
  --context 16384 --json > "$out/advise-decaying.json"
"$py" -m dspark_calib advise "$table" --acceptance 0.9,0.8,0.7,0.55,0.4,0.3,0.2 --context 1024 --context 4096 \
  --context 16384 > "$out/advise-decaying.txt" 2>&1
tail -3 "$out/advise-decaying.txt"
cp "$table" "$out/arms/"
arm() {  # arm NAME NEED_S SHARE_S
  if [ "$(left)" -lt "$2" ]; then echo "skip $1: $(left) s left"; return; fi
  local share=$3; [ "$share" -gt "$(( $(left) - 5 ))" ] && share=$(( $(left) - 5 ))
  echo "== arm $1 $(date -u +%T), at most $share s"
  "$py" benchmarks/serving/serve_context.py arm "$1" --table "$out/arms/$spec.parquet" --out "$out/arms" \
    --workloads ctx1k-c32,ctx4k-c32 --acceptance-rates decaying --waves 2 --policy warn \
    --deadline-epoch $(( $(date +%s) + share ))
  echo "arm $1 rc=$? $(date -u +%T)"; killgpu
}
arm "$spec-ab-tail20-chunks-noobs-pinned" 360 "$ab_share"
arm "$spec-fixed" 220 "$fixed_share"
"$py" benchmarks/serving/serve_context.py report --results "$out/arms"; echo "report rc=$?"
