#!/usr/bin/env bash
# Step `tenants` of benchmarks/gpu/run.sh: tenant GPU shares through the serving stack: `manage.py serve` at default flags (model flags and
# --tenant-id only) with team1=30% and team2=70%, flooded by benchmarks/tenant_shares.py (its scenarios: both
# tenants with equal and with random output lengths, one tenant alone, a late tenant, three tenants 20/30/50).
#
# Run from the repository root with what `make gpu-pack` builds (.gpuserve, .gpucache/qwen2.5-7b).
# Writes $OUT/$RESULT and serve.log.
# Two engines on the one GPU: WORKERS=2 EXTRA_FLAGS="--gpu-memory-utilization 0.42" SCENARIOS=uniform,random.
set -u
MODEL=${MODEL:-.gpucache/qwen2.5-7b}
SERVED_NAME=${SERVED_NAME:-qwen2.5-7b}
MODEL_FLAGS=${MODEL_FLAGS:---load-format dummy --dtype bfloat16 --max-model-len 2048}
WORKERS=${WORKERS:-1}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
SCENARIOS=${SCENARIOS:-uniform,random,alone,late,three}
NUM_PROMPTS=${NUM_PROMPTS:-256}
IN_LEN=${IN_LEN:-128}
OUT_LEN=${OUT_LEN:-256}
RESULT=${RESULT:-tenant_shares.json}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
source benchmarks/gpu/serving_env.sh

if start_serve "$MODEL" "$SERVED_NAME" $MODEL_FLAGS --tenant-id team1=30% --tenant-id team2=70% \
    --data-parallel-size "$WORKERS" $EXTRA_FLAGS; then
  timeout "$(cap 420)" $PY benchmarks/tenant_shares.py --base-url "http://127.0.0.1:$PORT" --model "$SERVED_NAME" \
    --tenants team1=30,team2=70 --three a=20,b=30,c=50 --scenarios "$SCENARIOS" --num-prompts "$NUM_PROMPTS" \
    --input-len "$IN_LEN" --output-len "$OUT_LEN" --result-json "$OUT/$RESULT" \
    || log "FAILED: tenant_shares.py (exit $?)"
fi
log "stopping the server"
stop_serve
grep -c . "$WORK/serve.log" >/dev/null && { echo "--- serve.log (last 15 lines)"; tail -15 "$WORK/serve.log"; }
log "done"; ls -la "$OUT"
