#!/usr/bin/env bash
# Step 3. GPU 0: serve-time proof with the table from step 2 (warm compile cache).
# GPU 1, at the same time: stability profile B (context 8192), same cache as A.
set -euo pipefail
. benchmarks/h200/setup.sh
(CUDA_VISIBLE_DEVICES=1 VLLM_CACHE_ROOT=/tmp/cache-b bash benchmarks/h200/profile.sh h200-tp1-ctx8192-b \
   --tp 1 --context-len 8192 --replays 20 > /tmp/b.txt 2>&1; echo "stability B rc=$?" >> /tmp/b.txt) &
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/h200/serve_proof.py /tmp/results/h200-tp1.parquet "$OUT" 2>&1 | tail -40
wait
tail -25 /tmp/b.txt
