#!/usr/bin/env bash
# Issue 9 item 6 on one idle H200: context-aware costs at serve time, one device call per step.
# From the repo root, after the wheel parts are received (recv.sh) and with WHEELS_SHA256 set:
#   bash benchmarks/h200/run_context.sh table          # setup + the 3-context table (1024/8192/16384), ~6 min
#   bash benchmarks/h200/run_context.sh arm stock      # one engine start per arm, every workload, ~4-5 min
#   bash benchmarks/h200/run_context.sh arm static
#   bash benchmarks/h200/run_context.sh arm aware
# Anywhere (no GPU), after copying each call's files into benchmarks/results/h200/:
#   bash benchmarks/h200/run_context.sh report         # serve_context.json + serve_context.md there
#   PYTHON=.venv/bin/python bash benchmarks/h200/run_context.sh dry-run   # CPU: 3 arms on the fake engine + report
# The arms use the table from, in order: $TABLE (a path, or "shipped"), /tmp/results (the table
# call on this host), benchmarks/results/h200/ (copied back into the repo: it travels), the shipped one.
# Every call writes at most 4 files under $OUT (table: NAME.parquet/.log/.vllm.log/-samples-rank0.json;
# arm: context-ARM.json/-requests.json/-observed.parquet/.log).
set -euo pipefail
T0=$(date +%s)
NAME=h200-tp1-ctx3-serve
SHIPPED=profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet
HARNESS=benchmarks/h200/serve_context.py
BUDGET_S=${CALL_BUDGET_S:-570}  # the device tool stops a command at 600 s
PY=${PYTHON:-python3}  # report / dry-run off the host: a Python with dspark_calib's deps (e.g. .venv/bin/python)

find_table() {
  if [ -n "${TABLE:-}" ]; then
    if [ "$TABLE" = shipped ]; then echo "$SHIPPED"; else echo "$TABLE"; fi
    return
  fi
  for t in "/tmp/results/$NAME.parquet" "benchmarks/results/h200/$NAME.parquet" "$SHIPPED"; do
    if [ -f "$t" ]; then echo "$t"; return; fi
  done
  echo "no table found" >&2; exit 1
}

case "${1:-}" in
  table)
    # replays 10 (+2 warm-up blocks): 3 contexts x 56 sizes x 15 samples; the 20-replay run of the same
    # table took 407 s engine start (274 s profiling) on a cold host, this one ~300 s.
    bash benchmarks/h200/profile.sh "$NAME" --tp 1 --context-len 1024 --context-len 8192 --context-len 16384 \
      --replays "${REPLAYS:-10}" --max-model-len 32768
    ;;
  arm)
    arm=${2:?usage: run_context.sh arm stock|static|aware}
    . benchmarks/h200/setup.sh
    table=$(find_table)
    echo "arm $arm: table $table ($(sha256sum "$table" | cut -c1-12)); $(( $(date +%s) - T0 )) s spent on setup"
    python3 "$HARNESS" arm "$arm" --table "$table" --out "${OUT:?}" --deadline-epoch $((T0 + BUDGET_S)) \
      ${ARM_ARGS:-}
    ;;
  report)
    "$PY" "$HARNESS" report "${@:2}"
    ;;
  dry-run)
    dry=${DRY_OUT:-/tmp/serve-context-dry}
    rm -rf "$dry" && mkdir -p "$dry"
    table=$(find_table)
    for arm in stock static aware; do
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" "$HARNESS" arm "$arm" --table "$table" --out "$dry" \
        --work "$dry/work-$arm" --dry-run ${ARM_ARGS:-}
    done
    rm -rf "$dry"/work-*
    "$PY" "$HARNESS" report --results "$dry" --json "$dry/serve_context.json" --md "$dry/serve_context.md"
    ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac
