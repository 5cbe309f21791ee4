#!/usr/bin/env bash
# Issue 7 item 9(c), two-GPU host, device calls back to back in one lease (each under 10 minutes):
#   bash benchmarks/h200/run_tp2.sh profile [profile options]  # the tp 2 table (rank 0's samples, curves broadcast)
#   bash benchmarks/h200/run_tp2.sh serve [CASES]              # tp2_proof.py: tp 2 stock/table/tp-1-table-strict, DP 2
# Measured 2026-11-30 (x2 host): the three tp 2 cases take ~7 min and DP 2's first start compiles
# each replica (~4 min): run `serve tp` and `serve dp` as two calls. Never pipe the output
# through tail in the device command: a call cut by its time limit then returns nothing.
# serve uses the tables made earlier in the same lease (/tmp/results/h200-tp2.parquet,
# /tmp/results/fid-product-a.parquet from run_fidelity.sh product, or $TP1_TABLE), else the
# committed ones: they fit only a host with the same driver / torch / vLLM (checked keys).
set -euo pipefail
export CUDA_VISIBLE_DEVICES=0,1
case "$1" in
  profile) shift; bash benchmarks/h200/profile.sh h200-tp2 --tp 2 --max-model-len 32768 "$@" ;;
  serve) . benchmarks/h200/setup.sh
         # a table made earlier in this lease, else the committed ones (made on an x2 host on 2026-11-30)
         tp2=/tmp/results/h200-tp2.parquet; [ -f "$tp2" ] || tp2=$(ls profiles/h200/*__tp2__*.parquet | head -1)
         tp1=${TP1_TABLE:-/tmp/results/fid-product-a.parquet}; [ -f "$tp1" ] || tp1=benchmarks/results/h200/fidelity/fid-product-a.parquet
         python3 benchmarks/h200/tp2_proof.py "$tp2" "$tp1" "$OUT" "${2:-tp,dp}" ;;
  *) echo "usage: run_tp2.sh profile|serve" >&2; exit 2 ;;
esac
