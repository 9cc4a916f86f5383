#!/usr/bin/env bash
# Step `serving` of benchmarks/gpu/run.sh: W1 through the serving stack (Daphne + one Celery engine worker +
# Redis), measured with benchmarks/serving.py (vLLM's options), then the offline engine (benchmarks/throughput.py)
# on the same workload (256 random-token prompts of 1024 tokens, 512 output tokens each, ignore_eos).
# Needs what `make gpu-pack` builds (.gpuserve: wheels and redis-server; .gpucache/qwen2.5-7b: config and
# tokenizer, no weights: --load-format dummy). Writes to $OUT: w1_serving.json, w1_offline.json, w1_summary.json
# and serve.log; run.sh renames them by workload, device and date.
#
# Every value can be overridden from the environment (a CPU rehearsal does so): PY, MODEL, SERVED_NAME,
# ENGINE_FLAGS, OFFLINE_FLAGS, CLIENT_FLAGS (more benchmarks/serving.py flags), EXTRA_SERVE_FLAGS (a second server
# with these flags added runs the same benchmark: w1_serving_extra.json), PROFILE (1: py-spy stacks of the worker and a
# web process), IN_LEN, OUT_LEN, NUM_PROMPTS, CONCURRENCY, WHEELS (0: skip the install),
# REDIS_BIN (a redis-server to use instead of the carried one), BUDGET (seconds for the whole script;
# every stage's timeout is capped by what is left of it).
set -u
MODEL=${MODEL:-.gpucache/qwen2.5-7b}
SERVED_NAME=${SERVED_NAME:-qwen2.5-7b}
ENGINE_FLAGS=${ENGINE_FLAGS:---load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256}
OFFLINE_FLAGS=${OFFLINE_FLAGS:---load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256}
IN_LEN=${IN_LEN:-1024}
OUT_LEN=${OUT_LEN:-512}
NUM_PROMPTS=${NUM_PROMPTS:-256}
CONCURRENCY=${CONCURRENCY:-256}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
source benchmarks/gpu/serving_env.sh

# py-spy (carried in .gpuserve/tools by `make gpu-pack`), when PROFILE=1: 8 s of the engine worker's and one web
# process's Python stacks while the benchmark runs (raw folded stacks in $OUT/w1_pyspy_<role>.txt).
profile_processes() {
  [ "${PROFILE:-0}" = 1 ] || return 0
  local spy; spy=$(ls /tmp/tools/bin/py-spy 2>/dev/null) || spy=""
  if [ -z "$spy" ] && ls .gpuserve/tools/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/tools .gpuserve/tools/*.whl >/dev/null 2>&1
    spy=$(ls /tmp/tools/bin/py-spy 2>/dev/null) || spy=""
  fi
  [ -n "$spy" ] || { log "PROFILE: no py-spy"; return 0; }
  sleep 4
  local worker web
  worker=$($PY -c "import psutil; print(next((c.pid for c in psutil.Process($SERVE_PID).children(recursive=True) if ' worker ' in ' '.join(c.cmdline())), ''))")
  web=$($PY -c "import psutil; print(next((c.pid for c in psutil.Process($SERVE_PID).children(recursive=True) if 'daphne' in ' '.join(c.cmdline())), ''))")
  for pair in "worker:$worker" "web:$web"; do
    [ -n "${pair#*:}" ] && "$spy" record -p "${pair#*:}" -d 8 -r 200 -f raw --idle -o "$OUT/w1_pyspy_${pair%%:*}.txt" \
      >"$OUT/w1_pyspy_${pair%%:*}.log" 2>&1 &
  done
  wait
}

# 3. The server.
SERVING_OK=0
if ! $PY manage.py serve --help | grep -q -- "--load-format" && [[ " $ENGINE_FLAGS " == *" --load-format "* ]]; then
  log "SKIPPED serving: 'manage.py serve' has no --load-format flag (webapp/cli.py ENGINE_FLAGS lacks it)"
else
  if start_serve "$MODEL" "$SERVED_NAME" $ENGINE_FLAGS; then
    B="$PY benchmarks/serving.py --base-url http://127.0.0.1:$PORT --model $SERVED_NAME --dataset-name random ${CLIENT_FLAGS:-}"
    # Warm-up (not measured): two full-length prompts, as throughput.py warms its engine with two.
    timeout "$(cap 90)" $B --random-input-len "$IN_LEN" --random-output-len 8 --num-prompts 2 --max-concurrency 2 \
      --ignore-eos --seed 1 --save-result --result-dir "$WORK" --result-filename warmup.json >"$WORK/warmup.txt" 2>&1
    if $PY -c "import json, sys; m = json.load(open('$WORK/warmup.json')); sys.exit(m['completed'] != 2)" 2>/dev/null; then
      log "warm-up done; benchmark: $NUM_PROMPTS prompts, in $IN_LEN, out $OUT_LEN, concurrency $CONCURRENCY"
      profile_processes & PROFILER=$!
      timeout "$(cap 240)" $B --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --max-concurrency "$CONCURRENCY" --ignore-eos --save-result --result-dir "$OUT" --result-filename w1_serving.json \
        && SERVING_OK=1 || log "FAILED: serving benchmark (exit $?)"
      wait $PROFILER
      # The server's own view (vLLM's metric names): the engine-side queue, prefill and decode times.
      $PY -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
        >"$OUT/w1_serve_metrics.txt" 2>/dev/null || log "could not read /metrics"
      if [ -n "${EXTRA_SERVE_FLAGS:-}" ]; then   # a second server with other flags, same workload
        stop_serve
        if start_serve "$MODEL" "$SERVED_NAME" $ENGINE_FLAGS $EXTRA_SERVE_FLAGS; then
          B="$PY benchmarks/serving.py --base-url http://127.0.0.1:$PORT --model $SERVED_NAME --dataset-name random ${CLIENT_FLAGS:-}"
          timeout "$(cap 90)" $B --random-input-len "$IN_LEN" --random-output-len 8 --num-prompts 2 --max-concurrency 2 \
            --ignore-eos --seed 1 >/dev/null 2>&1
          log "second server ($EXTRA_SERVE_FLAGS): benchmark"
          timeout "$(cap 240)" $B --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --num-prompts "$NUM_PROMPTS" \
            --max-concurrency "$CONCURRENCY" --ignore-eos --save-result --result-dir "$OUT" \
            --result-filename w1_serving_extra.json || log "FAILED: second serving benchmark (exit $?)"
        fi
      fi
    else
      log "FAILED: warm-up requests did not complete:"; cat "$WORK/warmup.txt"
    fi
  fi
  log "stopping the server"
  cleanup_serve_start=$SECONDS
  stop_serve
  log "stopped in $((SECONDS - cleanup_serve_start)) s"
  echo "--- serve.log (last 25 lines)"; tail -25 "$WORK/serve.log"; echo "---"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader

# 4. The offline engine on the same workload (same lengths, counts and engine flags; its own random ids).
log "offline: benchmarks/throughput.py $OFFLINE_FLAGS"
timeout "$(cap 240)" $PY benchmarks/throughput.py --model "$MODEL" $OFFLINE_FLAGS --peer none \
  --num-prompts "$NUM_PROMPTS" --input-len "$IN_LEN" --output-len "$OUT_LEN" --output-json "$OUT/w1_offline.json" \
  2>&1 | grep -v -e tokenizer -e "^INFO"

# 5. Summary.
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
s = json.loads((out / "w1_serving.json").read_text()) if (out / "w1_serving.json").exists() else None
o = json.loads((out / "w1_offline.json").read_text())["tessera"] if (out / "w1_offline.json").exists() else None
summary = {}
if s:
    summary["serving"] = {k: s[k] for k in ("completed", "failed", "duration", "output_throughput", "median_ttft_ms",
                                            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "errors")}
if o:
    summary["offline"] = {k: o[k] for k in ("seconds", "output_tokens_per_s", "median_ttft_s", "median_tpot_ms",
                                            "p99_tpot_ms")}
if s and o:
    summary["serving_over_offline_throughput"] = s["output_throughput"] / o["output_tokens_per_s"]
x = json.loads((out / "w1_serving_extra.json").read_text()) if (out / "w1_serving_extra.json").exists() else None
if x:
    summary["serving_extra"] = {k: x[k] for k in ("completed", "output_throughput", "median_ttft_ms", "median_tpot_ms")}
metrics = out / "w1_serve_metrics.txt"
if metrics.exists():  # the engine's side of the served run (vLLM's histograms: sums and counts)
    values = {}
    for line in metrics.read_text().splitlines():
        if line.startswith("vllm:") and "{" in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[-1]
            values[name] = values.get(name, 0.0) + float(value)
    def mean(name):
        count = values.get(f"vllm:{name}_count")
        return values.get(f"vllm:{name}_sum", 0.0) / count if count else None
    tokens, requests = values.get("vllm:generation_tokens_total"), values.get("vllm:request_decode_time_seconds_count")
    summary["engine_side"] = {
        "mean_queue_s": mean("request_queue_time_seconds"), "mean_prefill_s": mean("request_prefill_time_seconds"),
        "mean_ttft_s": mean("time_to_first_token_seconds"), "mean_decode_s": mean("request_decode_time_seconds"),
        "mean_tpot_ms": 1e3 * values["vllm:request_decode_time_seconds_sum"] / (tokens - requests)
        if tokens and requests and tokens > requests else None,
        "note": "the served run and its warm-up; mean_tpot_ms: decode time over the tokens after each first one"}
print(json.dumps(summary, indent=1))
(out / "w1_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
log "done"; ls -la "$OUT"
