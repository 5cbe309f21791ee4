#!/usr/bin/env bash
# session driver: issue 23's shape run on a fresh H200 lease (a second host held out from the shipped
# table): profile with --shape-replays, stock and context-aware arms observing every step, the
# shape pricing and the judge (shipped table beside) -> OUT
set -u
out=${1:?OUT}; end=${2:?END}
bash benchmarks/proofs/shape_profile.sh "$out" "$end"
echo "shape_profile rc=$? $(date -u +%T) left $(( end - $(date +%s) ))"
echo "driver done $(date -u +%T)"
