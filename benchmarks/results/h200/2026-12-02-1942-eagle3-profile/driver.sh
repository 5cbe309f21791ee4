#!/usr/bin/env bash
# session driver: the EAGLE-3 A/B; if no EAGLE-3 table could be made and enough time is left, the shape profile
set -u
out=${1:?OUT}; end=${2:?END}
bash benchmarks/proofs/speculator_ab.sh eagle3 "$out/eagle3" "$end"
echo "speculator_ab rc=$? $(date -u +%T) left $(( end - $(date +%s) ))"
if [ ! -f "$out/eagle3/eagle3.parquet" ] && [ $(( end - $(date +%s) )) -ge 1000 ]; then
  echo "== fallback: shape_profile"
  bash benchmarks/proofs/shape_profile.sh "$out/shape" "$end"
  echo "shape_profile rc=$? $(date -u +%T)"
fi
echo "driver done $(date -u +%T)"
