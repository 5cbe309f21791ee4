#!/usr/bin/env bash
# Step 4 (two-GPU host): tensor parallel 2, samples from rank 0, curves broadcast by vLLM.
set -euo pipefail
CUDA_VISIBLE_DEVICES=0,1 bash benchmarks/h200/profile.sh h200-tp2 --tp 2 "$@"
