#!/usr/bin/env bash
# session driver: the EAGLE-3 A/B with the shipped EAGLE-3 table (decaying + fixed, flat, strict load)
set -u
out=${1:?OUT}; end=${2:?END}
TABLE=profiles/h200/qwen3-8b__eagle3-qwen3-8b__tp1__nvidia-h200__81458b2ae409.parquet \
WORKLOADS=ctx1k-c32,ctx16k-c16,mix-c16 SCHEDULES=decaying,flat AB_SHARE=480 FIXED_SHARE=280 STRICT_SHARE=240 \
  bash benchmarks/proofs/speculator_ab.sh eagle3 "$out/eagle3" "$end"
echo "speculator_ab rc=$? $(date -u +%T) left $(( end - $(date +%s) ))"
echo "driver done $(date -u +%T)"
