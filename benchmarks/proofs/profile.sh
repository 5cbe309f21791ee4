#!/usr/bin/env bash
# On the H200 host: `dspark-calib profile` as a user runs it. Usage: profile.sh NAME [profile options...]
# Writes, all under $OUT:
#   NAME.parquet              the table
#   NAME.vllm.log             vLLM's own output (the CLI writes it beside the table)
#   NAME.log                  nvidia-smi + the command's terminal output (plan line, errors, summary)
#   NAME-samples-rank0.json   the raw capture from TP rank 0 (--keep-capture)
# and copies the table and vLLM's log to /tmp/results.
set -euo pipefail
name=$1; shift
. benchmarks/h200/setup.sh
log="$OUT/$name.log"
vlog="$OUT/$name.vllm.log"  # profile_cmd.check_out: --out X.parquet puts vLLM's log at X.vllm.log
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; \
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-default}"; } > "$log"
cap=/tmp/capture-$name
rm -rf "$cap"  # no stale rank files from an earlier run of the same name
python3 -m dspark_calib profile --model "$PWD/profiles/configs/qwen3-8b" --draft "$PWD/profiles/configs/dspark-qwen3-8b-block7" \
  --max-num-seqs 256 --max-num-batched-tokens 8192 --num-speculative-tokens 7 \
  --out "$OUT/$name.parquet" --keep-capture "$cap" "$@" >> "$log" 2>&1 || {
    echo "profile $name FAILED"; tail -20 "$log"
    if [ -f "$vlog" ]; then echo "--- $vlog"; tail -60 "$vlog"; fi
    exit 1; }
cp "$cap/samples-rank0.json" "$OUT/$name-samples-rank0.json"
mkdir -p /tmp/results && cp "$OUT/$name.parquet" "$vlog" /tmp/results/
grep -v "^(EngineCore\|^\[\|it/s\]" "$log" | tail -45
