#!/usr/bin/env bash
# Issue 8's fidelity proof, two device calls back to back in one lease (each under 10 minutes):
#   bash benchmarks/h200/run_fidelity.sh stock     # setup + two stock vLLM start-up profiles -> $OUT/stock_{a,b}.json
#   bash benchmarks/h200/run_fidelity.sh product   # two `dspark-calib profile` runs, ctx 8192, 20 replays -> $OUT (8 files)
# then, here: python3 benchmarks/h200/fidelity.py report DIR   (DIR: both calls' files together)
# GPU 0 only; nothing else runs on it (the second GPU of a two-GPU host stays idle).
set -euo pipefail
export CUDA_VISIBLE_DEVICES=0
. benchmarks/h200/setup.sh
case "$1" in
  stock) nvidia-smi --query-gpu=index,name,driver_version,memory.used,utilization.gpu --format=csv,noheader
         python3 benchmarks/h200/fidelity.py stock "$OUT" ;;
  product) for ab in a b; do
             bash benchmarks/h200/profile.sh "fid-product-$ab" --tp 1 --context-len 8192 --replays 20 --max-model-len 32768
             sleep 3; nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null || true
           done ;;
  *) echo "usage: run_fidelity.sh stock|product" >&2; exit 2 ;;
esac
