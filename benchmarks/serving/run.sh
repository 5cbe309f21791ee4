#!/usr/bin/env bash
# One comparison of arms.json, every arm one after another on this host (one idle GPU), then the report.
#   bash benchmarks/serving/run.sh COMPARISON TABLE OUT [arm options...]
#     COMPARISON  a name under "comparisons" in arms.json (e.g. defaults: stock, aware-tail20-chunks, aware,
#                 stock-rerun: the baseline first and repeated last, so its spread is measured in the same run)
#     TABLE       the multi-context table the table arms load and every arm validates with (a table profiled
#                 on this host: bash benchmarks/proofs/profile.sh NAME --tp 1 --context-len 1024
#                 --context-len 8192 --context-len 16384 --replays 20 --max-model-len 32768)
#     OUT         the run's folder: context-ARM.{json,-requests.json,-observed.parquet,.log} per arm, a copy of
#                 TABLE (the report re-validates the observe files with the table beside them), serve_context.{json,md}
# DRY_RUN=1: the harness's fake engine on CPU (no vLLM, no GPU), the whole control flow in ~1 min.
# From the repository root, after `pip install '.[vllm]'` (the dry run needs only '.').
set -euo pipefail
cmp=${1:?usage: run.sh COMPARISON TABLE OUT [arm options...]}; table=${2:?TABLE}; out=${3:?OUT}; shift 3
py=${PYTHON:-python3}
harness=benchmarks/serving/serve_context.py
arms=$("$py" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["comparisons"][sys.argv[2]]))' \
  benchmarks/serving/arms.json "$cmp")
mkdir -p "$out"
cp -n "$table" "$out/" 2>/dev/null || true
dry=(); [ -n "${DRY_RUN:-}" ] && dry=(--dry-run --work "$out/.work")
for arm in $arms; do
  echo "== arm $arm ($(date -u +%H:%M:%S))"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" "$harness" arm "$arm" --table "$out/$(basename "$table")" \
    --out "$out" "${dry[@]}" "$@"
done
rm -rf "$out/.work"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$py" "$harness" report --results "$out"  # this checkout's dspark_calib, as the arms
