#!/usr/bin/env bash
# Issue 7 item 9 on one idle H200, one call per step (each under the device tool's 10-minute limit):
#   bash benchmarks/h200/run_trust.sh profile   # setup + a fresh ctx-8192 table (cold host)
#   bash benchmarks/h200/run_trust.sh cases A,B  # trust_proof.py cases, one engine start each
set -euo pipefail
. benchmarks/h200/setup.sh
name=h200-tp1-ctx8192-trust
case "$1" in
  profile) bash benchmarks/h200/profile.sh "$name" --tp 1 --context-len 8192 --replays 20 --max-model-len 32768 ;;
  cases) python3 benchmarks/h200/trust_proof.py "/tmp/results/$name.parquet" /tmp/trust-out "$2"
         cp /tmp/trust-out/trust_proof.json "$OUT/" ;;
esac
