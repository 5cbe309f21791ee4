#!/usr/bin/env bash
# session driver: issue 22's remainder with the shipped EAGLE-3 table: strict load + fixed K at the
# decaying schedule first, then the flat-schedule A/B and fixed K at the flat schedule
set -u
out=${1:?OUT}; end=${2:?END}
T=profiles/h200/qwen3-8b__eagle3-qwen3-8b__tp1__nvidia-h200__81458b2ae409.parquet
TABLE=$T WORKLOADS=ctx1k-c32,ctx16k-c16,mix-c16 AB_SCHEDULES= FIXED_SCHEDULES=decaying FIXED_SHARE=280 STRICT_SHARE=240 \
  bash benchmarks/proofs/speculator_ab.sh eagle3 "$out/eagle3" "$end"
echo "speculator_ab (strict, fixed decaying) rc=$? $(date -u +%T) left $(( end - $(date +%s) ))"
TABLE=$T WORKLOADS=ctx1k-c32,ctx16k-c16,mix-c16 AB_SCHEDULES=flat FIXED_SCHEDULES=flat AB_SHARE=480 FIXED_SHARE=280 STRICT=0 \
  bash benchmarks/proofs/speculator_ab.sh eagle3 "$out/eagle3" "$end"
echo "speculator_ab (flat A/B, fixed flat) rc=$? $(date -u +%T) left $(( end - $(date +%s) ))"
echo "driver done $(date -u +%T)"
