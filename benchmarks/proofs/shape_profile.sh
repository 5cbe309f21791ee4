#!/usr/bin/env bash
# A second verify shape beside the profile's, judged on held-out served steps, on one idle H200
# (the DSpark engine of profile.sh):
#   1. profile 1024 / 8192 / 16384 (replays 5, startup state) with --shape-replays 5: the sizes above
#      the capture limit also timed as size / 8 requests of 8 tokens -> OUT/tables/shapes.parquet and the kept
#      capture OUT/tables/shapes-samples-rank0.json (its shape_samples)
#   2. stock vLLM serves ctx3k, ctx12k and mix-2-4-12k (arms.json) with observe on every step -> OUT/arms
#   3. the context-aware engine with table 1 at the plugin's defaults, the same workloads -> OUT/arms
#   4. shape_pricing.py prices both arms' decode verifies with the profile's shape and with the two
#      shapes: decided on ctx3k, reported on ctx12k and the mix -> OUT/shapes-{stock,aware}.{json,md};
#      judge_tables.py beside it, the shipped table judged too -> OUT/judge-{stock,aware}.{json,md}
# Usage, from the repository root on a GPU host where `pip install '.[vllm]'` is done:
#   bash benchmarks/proofs/shape_profile.sh OUT END_EPOCH
# Every step gets a share of the time left before END_EPOCH and is stopped at its end; a step
# that no longer fits is skipped and said so.
set -u
out=${1:?usage: shape_profile.sh OUT END_EPOCH}; end=${2:?END_EPOCH}
mkdir -p "$out/tables" "$out/arms"
py=${PYTHON:-python3}
left() { echo $(( end - $(date +%s) )); }
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
{ date -u; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; } 2>&1
table="$out/tables/shapes.parquet"
# the shipped table (profiled on another H200 of the pool): this host is held out from it
shipped=profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet
if [ "$(left)" -ge 300 ]; then
  share=480; [ "$share" -gt "$(( $(left) - 5 ))" ] && share=$(( $(left) - 5 ))
  echo "== profile shapes $(date -u +%T), at most $share s"
  rm -f "$table"
  OUT="$out/tables" timeout -k 10 "$share" bash benchmarks/proofs/profile.sh shapes --tp 1 \
    --context-len 1024 --context-len 8192 --context-len 16384 --replays 5 --max-model-len 32768 --shape-replays 5
  echo "profile rc=$? $(date -u +%T)"; killgpu
else
  echo "skip profile: $(left) s left"
fi
[ -f "$table" ] || { echo "no table: nothing to serve with or judge"; exit 1; }
arm() {  # arm NAME [options...]: the engine child stops 65 s before its deadline (KILL_MARGIN_S)
  local name=$1; shift
  if [ "$(left)" -lt 300 ]; then echo "skip arm $name: $(left) s left"; return 1; fi
  local share=420; [ "$share" -gt "$(( $(left) - 30 ))" ] && share=$(( $(left) - 30 ))
  echo "== arm $name $(date -u +%T), at most $share s"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" benchmarks/serving/serve_context.py arm "$name" \
    --table "$table" --out "$out/arms" --workloads ctx3k,ctx12k,mix-2-4-12k --waves 2 --observe-every 1 \
    --deadline-epoch $(( $(date +%s) + share )) "$@"
  local rc=$?; echo "arm $name rc=$rc $(date -u +%T)"; killgpu; return $rc
}
arm stock
arm aware-tail20-chunks
for a in stock:stock aware-tail20-chunks:aware; do
  name=${a%%:*}; short=${a##*:}
  [ -f "$out/arms/context-$name-observed.parquet" ] || { echo "no observe file of arm $name"; continue; }
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" benchmarks/serving/shape_pricing.py \
    "$out/tables/shapes-samples-rank0.json" "$table" "$out/arms" "$name" --decide ctx3k \
    --json "$out/shapes-$short.json" --md "$out/shapes-$short.md"
  echo "shape_pricing $name rc=$?"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" benchmarks/serving/judge_tables.py "$out/arms" "$name" \
    --table "shapes=$table" --table "shipped=$shipped" --decide ctx3k --json "$out/judge-$short.json" \
    --md "$out/judge-$short.md" > /dev/null
  echo "judge $name rc=$?"
done
