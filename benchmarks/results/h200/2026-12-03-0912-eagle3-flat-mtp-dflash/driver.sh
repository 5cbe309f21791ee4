#!/usr/bin/env bash
# session driver: issue 22's flat schedule with the shipped EAGLE-3 table (the in-engine A/B and
# fixed K=7, one host), then `dspark-calib profile` of the MTP (MiMo-7B) and DFlash (block 16) engines
set -u
out=${1:?OUT}; end=${2:?END}
py=${PYTHON:-python3}
left() { echo $(( end - $(date +%s) )); }
killgpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 3; }
T=profiles/h200/qwen3-8b__eagle3-qwen3-8b__tp1__nvidia-h200__81458b2ae409.parquet
TABLE=$T WORKLOADS=ctx1k-c32,ctx16k-c16,mix-c16 AB_SCHEDULES=flat FIXED_SCHEDULES=flat AB_SHARE=480 FIXED_SHARE=280 \
  STRICT=0 bash benchmarks/proofs/speculator_ab.sh eagle3 "$out/eagle3" "$end"
echo "speculator_ab (flat A/B, fixed flat) rc=$? $(date -u +%T) left $(left)"
killgpu
prof() {  # prof NAME MIN_S profile-options...: one profile under a timeout of what is left (at most 380 s)
  local name=$1 need=$2; shift 2
  local share=380; [ "$share" -gt "$(( $(left) - 5 ))" ] && share=$(( $(left) - 5 ))
  if [ "$share" -lt "$need" ]; then echo "skip profile $name: $(left) s left"; return 1; fi
  mkdir -p "$out/$name"; local cap; cap=$(mktemp -d /tmp/capture-$name.XXXXXX)
  echo "== profile $name $(date -u +%T), at most $share s"
  { date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; } > "$out/$name/$name.log"
  timeout -k 10 "$share" "$py" -m dspark_calib profile --max-num-seqs 256 --max-num-batched-tokens 8192 \
    --context-len 1024 --context-len 8192 --context-len 16384 --replays 5 --max-model-len 32768 \
    --out "$out/$name/$name.parquet" --keep-capture "$cap" "$@" >> "$out/$name/$name.log" 2>&1
  echo "profile $name rc=$? $(date -u +%T) left $(left)"
  cp "$cap/samples-rank0.json" "$out/$name/$name-samples-rank0.json" 2>/dev/null
  grep -v "^(EngineCore\|^\[\|it/s\]" "$out/$name/$name.log" | tail -25
  killgpu
}
prof mtp 240 --model "$PWD/profiles/configs/mimo-7b" --method mtp --num-speculative-tokens 3
prof dflash 240 --model "$PWD/profiles/configs/qwen3-8b" --draft "$PWD/profiles/configs/dflash-qwen3-8b-b16" \
  --method dflash --num-speculative-tokens 15
echo "driver done $(date -u +%T)"
