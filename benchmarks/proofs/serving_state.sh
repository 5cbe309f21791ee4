#!/usr/bin/env bash
# The profile's GPU state against serving's, on one idle H200 (DSpark engine of profile.sh):
#   1. profile 1024 / 8192 / 16384 in the startup state (vLLM's way: idle before every block)
#      -> OUT/tables/startup.parquet
#   2. the same in the serving state (every block after its heaviest step ran back to back until
#      the SM clock and power hold) -> OUT/tables/serving.parquet
#   3. stock vLLM (its own start-up profile) serves workloads no table profiles (ctx3k, ctx12k,
#      mix-2-4-12k of arms.json) with observe mode on every priced step -> OUT/arms
#   4. the startup profile again while time lasts (the noise between two profiles of one state)
#   5. judge_tables.py prices stock's steps with each table (and the shipped one, profiled on
#      another H200): decided on ctx3k, reported on ctx12k and the mix -> OUT/judge.{json,md}
# Usage, from the repository root on a GPU host where `pip install '.[vllm]'` is done:
#   bash benchmarks/proofs/serving_state.sh OUT END_EPOCH
# Every step gets a share of the time left before END_EPOCH and is stopped at its end; a step
# that no longer fits is skipped and said so. Replays 5 (vLLM's own: one block per context) keep
# each profile short; how far two such profiles differ is in docs/results/2026-11-30-fidelity.md.
set -u
out=${1:?usage: serving_state.sh OUT END_EPOCH}; end=${2:?END_EPOCH}
mkdir -p "$out/tables" "$out/arms"
py=${PYTHON:-python3}
shipped=$(ls profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__*.parquet | head -1)
left() { echo $(( end - $(date +%s) )); }
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
profile() {  # profile NAME STATE NEED_S SHARE_S [options...]
  local name=$1 state=$2 need=$3 share=$4; shift 4
  if [ "$(left)" -lt "$need" ]; then echo "skip profile $name: $(left) s left"; return 1; fi
  [ "$share" -gt "$(( $(left) - 5 ))" ] && share=$(( $(left) - 5 ))
  echo "== profile $name ($state) $(date -u +%T), at most $share s"
  rm -f "$out/tables/$name.parquet"  # a table left by an earlier run is not this run's
  OUT="$out/tables" timeout -k 10 "$share" bash benchmarks/proofs/profile.sh "$name" --tp 1 \
    --context-len 1024 --context-len 8192 --context-len 16384 --replays 5 --max-model-len 32768 \
    --gpu-state "$state" "$@"
  local rc=$?; echo "profile $name rc=$rc $(date -u +%T)"; killgpu; return $rc
}
{ date -u; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; } 2>&1
tables=(--table "shipped=$shipped")
profile startup startup 300 420 && tables+=(--table "startup=$out/tables/startup.parquet")
profile serving serving 300 420 --settle 5 && tables+=(--table "serving=$out/tables/serving.parquet")
# the arm's engine child stops 65 s before its deadline (KILL_MARGIN_S); a stock start runs vLLM's
# own start-up profile, then the warm-up and the three workloads
if [ "$(left)" -ge 420 ]; then
  share=540; [ "$share" -gt "$(( $(left) - 30 ))" ] && share=$(( $(left) - 30 ))
  echo "== arm stock $(date -u +%T), at most $share s"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" benchmarks/serving/serve_context.py arm stock \
    --table "$shipped" --out "$out/arms" --workloads ctx3k,ctx12k,mix-2-4-12k --waves 2 --observe-every 1 \
    --deadline-epoch $(( $(date +%s) + share ))
  echo "arm stock rc=$? $(date -u +%T)"; killgpu
else
  echo "skip arm stock: $(left) s left"
fi
# the startup profile again, for the noise the two states are read against
profile startup-rerun startup 300 420 && tables+=(--table "startup-rerun=$out/tables/startup-rerun.parquet")
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" benchmarks/serving/judge_tables.py "$out/arms" stock "${tables[@]}" \
  --decide ctx3k --json "$out/judge.json" --md "$out/judge.md"
echo "judge rc=$?"
