#!/usr/bin/env bash
# `dspark-calib profile` as a user runs it, for the engine every proof and the serving harness
# start: Qwen3-8B + DSpark block-7 (profiles/configs/), dummy weights, max_num_seqs 256,
# max_num_batched_tokens 8192, 7 speculative tokens.
# Usage, from the repository root on a GPU host where `pip install '.[vllm]'` is done:
#   bash benchmarks/proofs/profile.sh NAME [profile options...]     e.g. --tp 1 --context-len 8192 --replays 20
#   METHOD=draft_model DRAFT=profiles/configs/qwen3-0.6b bash benchmarks/proofs/profile.sh NAME ...   another speculator
# Writes, all under $OUT (default out/proofs):
#   NAME.parquet              the table
#   NAME.vllm.log             vLLM's own output (the CLI writes it beside the table)
#   NAME.log                  nvidia-smi + the command's terminal output (plan line, errors, summary)
#   NAME-samples-rank0.json   the raw capture from TP rank 0 (--keep-capture)
set -euo pipefail
name=${1:?usage: profile.sh NAME [profile options...]}; shift
OUT=${OUT:-out/proofs}
mkdir -p "$OUT"
log="$OUT/$name.log"
vlog="$OUT/$name.vllm.log"  # --out X.parquet puts vLLM's log at X.vllm.log
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; \
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-default}"; } > "$log"
cap=$(mktemp -d "${TMPDIR:-/tmp}/capture-$name.XXXXXX")  # a fresh directory: no rank files from an earlier run
draft=${DRAFT:-profiles/configs/dspark-qwen3-8b-block7}
python3 -m dspark_calib profile --model "$PWD/profiles/configs/qwen3-8b" --draft "$PWD/${draft#$PWD/}" \
  --method "${METHOD:-dspark}" --max-num-seqs 256 --max-num-batched-tokens 8192 --num-speculative-tokens 7 \
  --out "$OUT/$name.parquet" --keep-capture "$cap" "$@" >> "$log" 2>&1 || {
    echo "profile $name FAILED"; tail -20 "$log"
    if [ -f "$vlog" ]; then echo "--- $vlog"; tail -60 "$vlog"; fi
    exit 1; }
cp "$cap/samples-rank0.json" "$OUT/$name-samples-rank0.json"
grep -v "^(EngineCore\|^\[\|it/s\]" "$log" | tail -45
