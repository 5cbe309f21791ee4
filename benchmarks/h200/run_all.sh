#!/usr/bin/env bash
# Step 2 (after one recv.sh call per part). GPU 0: the shipped tp1 table, 3 context lengths in one
# engine start. GPU 1, at the same time: stability profile A (context 8192), own compile cache.
set -euo pipefail
. benchmarks/h200/setup.sh
(CUDA_VISIBLE_DEVICES=1 VLLM_CACHE_ROOT=/tmp/cache-b bash benchmarks/h200/profile.sh h200-tp1-ctx8192-a \
   --tp 1 --context-len 8192 --replays 20 > /tmp/a.txt 2>&1; echo "stability A rc=$?" >> /tmp/a.txt) &
CUDA_VISIBLE_DEVICES=0 bash benchmarks/h200/profile.sh h200-tp1 --tp 1 --context-len 1024 --context-len 8192 --context-len 16384 --replays 20
wait
tail -25 /tmp/a.txt
