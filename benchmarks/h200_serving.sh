#!/usr/bin/env bash
# Tessera's serving stack on the lent H200: Daphne + one Celery engine worker + Redis, measured with
# benchmarks/serving.py (vLLM's options), then the offline engine (benchmarks/throughput.py) on the
# same workload (W1: 256 random-token prompts of 1024 tokens, 512 output tokens each, ignore_eos).
#
# Run from the repository root. Carried, git-ignored: .gpuserve (wheels the image lacks, redis-server
# and its libraries; built by benchmarks/gpuserve_pack.sh) and .gpucache/qwen2.5-7b (config + tokenizer, no
# weights: --load-format dummy). Writes to $OUT: w1_serving.json, w1_offline.json, w1_summary.json, serve.log.
# Device call: carry [".gpuserve", ".gpucache/qwen2.5-7b"]; command (session 15):
#   BUDGET=560 ENGINE_FLAGS="--load-format dummy --dtype bfloat16 --max-model-len 2048 \
#     --max-num-batched-tokens 16384 --max-num-seqs 256 --api-server-count 4" bash benchmarks/h200_serving.sh
#
# Every value can be overridden from the environment (the CPU rehearsal does so): PY, MODEL, SERVED_NAME,
# ENGINE_FLAGS, OFFLINE_FLAGS, IN_LEN, OUT_LEN, NUM_PROMPTS, CONCURRENCY, WHEELS (0: skip the install),
# REDIS_BIN (a redis-server to use instead of the carried one), BUDGET (seconds for the whole script;
# every stage's timeout is capped by what is left of it).
set -u
T0=$SECONDS
BUDGET=${BUDGET:-500}
PY=${PY:-python3}
MODEL=${MODEL:-.gpucache/qwen2.5-7b}
SERVED_NAME=${SERVED_NAME:-qwen2.5-7b}
ENGINE_FLAGS=${ENGINE_FLAGS:---load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256}
OFFLINE_FLAGS=${OFFLINE_FLAGS:---load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256}
IN_LEN=${IN_LEN:-1024}
OUT_LEN=${OUT_LEN:-512}
NUM_PROMPTS=${NUM_PROMPTS:-256}
CONCURRENCY=${CONCURRENCY:-256}
WHEELS=${WHEELS:-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/tessera-serving.XXXXXX)
export PYTHONUNBUFFERED=1 TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-/tmp/tessera-cache} TESSERA_LOGGING_LEVEL=WARNING
export TESSERA_DB_PATH=$WORK/db.sqlite3   # never the repository's db.sqlite3

log() { echo "[$(date +%T) +$((SECONDS - T0))s] $*"; }
cap() { local left=$((BUDGET - (SECONDS - T0))); [ $left -lt 5 ] && left=5; echo $(($1 < left ? $1 : left)); }
free_port() { $PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

# 1. Python packages: .gpuserve/whl always; .gpuserve/whl-ifold only where the image's copy is missing or
#    older than the carried packages need (installing them regardless would shadow the image's own).
if [ "$WHEELS" = 1 ]; then
  IFOLD=$($PY - <<'EOF'
import glob, os, sys
from importlib.metadata import PackageNotFoundError, version
from packaging.version import Version
NEED = {"click": (">=", "8.3.1", "celery 5.7"), "typing-extensions": (">=", "4.13.2", "twisted 26.10"),
        "python-dateutil": ("==", "2.9.0.post0", "celery 5.7"), "attrs": (">=", "22.2.0", "twisted 26.10"),
        "prometheus-client": (">=", "0.21", "requirements.txt")}
for whl in sorted(glob.glob(".gpuserve/whl-ifold/*.whl")):
    dist = os.path.basename(whl).split("-")[0].replace("_", "-").lower()
    op, need, who = NEED[dist]
    try:
        have = version(dist)
    except PackageNotFoundError:
        have = None
    ok = have is not None and (Version(have) == Version(need) if op == "==" else Version(have) >= Version(need))
    print(f"  {dist}: image has {have}, {who} needs {op}{need}: {'image copy kept' if ok else 'carried wheel installed'}",
          file=sys.stderr)
    if not ok:
        print(whl)
EOF
)
  log "installing $(ls .gpuserve/whl/*.whl | wc -l) + $(echo $IFOLD | wc -w) wheels into /tmp/site"
  timeout "$(cap 120)" $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpuserve/whl/*.whl $IFOLD 2>&1 | grep -v -i -e "warning" -e "^ *$" | tail -5
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'EOF' || { log "FAILED: the serving packages do not import"; exit 1; }
import importlib, importlib.metadata as md
for name in "django channels channels_redis daphne celery kombu redis twisted autobahn OpenSSL prometheus_client".split():
    importlib.import_module(name)
print("versions:", *(f"{d}={md.version(d)}" for d in ("django", "channels", "channels-redis", "daphne", "celery", "kombu",
      "redis", "twisted", "autobahn", "pyopenssl", "prometheus-client", "click", "typing-extensions", "attrs")))
EOF

# 2. Redis: the carried binary (libraries the image lacks from .gpuserve/redis/lib, gaps filled from lib-extra).
RPID=""; SERVE_PID=""; CHILDREN=""
cleanup() {
  if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -TERM "$SERVE_PID"   # serve stops Daphne, then the worker (SIGTERM, then SIGKILL after 15 s each)
    for _ in $(seq 90); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVE_PID" 2>/dev/null && { log "serve did not stop in 45 s: SIGKILL"; kill -KILL "$SERVE_PID"; }
  fi
  for pid in $CHILDREN; do kill -0 "$pid" 2>/dev/null && { log "child $pid still alive: SIGKILL"; kill -KILL "$pid"; }; done
  if [ -n "$RPID" ] && kill -0 "$RPID" 2>/dev/null; then
    kill -TERM "$RPID"; for _ in $(seq 20); do kill -0 "$RPID" 2>/dev/null || break; sleep 0.25; done
  fi
  SERVE_PID=""; CHILDREN=""; RPID=""
}
finish() {
  cleanup
  [ -f "$WORK/serve.log" ] && tail -c 200000 "$WORK/serve.log" >"$OUT/serve.log"
  rm -rf "$WORK"
}
trap finish EXIT
trap 'log "interrupted"; exit 130' INT TERM

if [ -z "${REDIS_BIN:-}" ]; then
  REDIS_BIN=.gpuserve/redis/redis-server; RLIB=.gpuserve/redis/lib
  for _ in 1 2 3; do   # each round can reveal the dependencies of the libraries found in the one before
    missing=$(LD_LIBRARY_PATH=$RLIB ldd "$REDIS_BIN" | awk '/not found/ {print $1}')
    [ -z "$missing" ] && break
    log "redis-server: the image lacks $(echo $missing); taking them from .gpuserve/redis/lib-extra"
    if [ "$RLIB" != "$WORK/redis-lib" ]; then
      mkdir -p "$WORK/redis-lib"; cp .gpuserve/redis/lib/* "$WORK/redis-lib/"; RLIB=$WORK/redis-lib
    fi
    for lib in $missing; do cp .gpuserve/redis/lib-extra/"$lib" "$RLIB/" || log "not carried: $lib"; done
  done
else
  RLIB=${LD_LIBRARY_PATH:-}
fi
RPORT=$(free_port)
LD_LIBRARY_PATH=$RLIB "$REDIS_BIN" --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" \
  --daemonize yes --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log" --loglevel warning
export REDIS_URL=redis://127.0.0.1:$RPORT/0
if timeout 15 $PY -c 'import os, time, redis
c = redis.Redis.from_url(os.environ["REDIS_URL"])
while True:
    try: print("redis", c.info("server")["redis_version"], "at", os.environ["REDIS_URL"]); break
    except redis.ConnectionError: time.sleep(0.1)'; then
  RPID=$(cat "$WORK/redis.pid")
else
  log "FAILED: redis-server did not start"; cat "$WORK/redis.log"; exit 1
fi

# 3. Database, then the server.
timeout "$(cap 60)" $PY manage.py migrate --noinput -v 0 && log "migrated $TESSERA_DB_PATH"
SERVING_OK=0
if ! $PY manage.py serve --help | grep -q -- "--load-format" && [[ " $ENGINE_FLAGS " == *" --load-format "* ]]; then
  log "SKIPPED serving: 'manage.py serve' has no --load-format flag (webapp/cli.py ENGINE_FLAGS lacks it)"
else
  PORT=$(free_port)
  log "serve $MODEL as '$SERVED_NAME' on port $PORT: $ENGINE_FLAGS"
  $PY manage.py serve "$MODEL" --served-model-name "$SERVED_NAME" --host 127.0.0.1 --port "$PORT" $ENGINE_FLAGS \
    --log-level warning >"$WORK/serve.log" 2>&1 &
  SERVE_PID=$!
  if timeout "$(cap 240)" $PY - "$PORT" "$SERVE_PID" <<'EOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
while True:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("serve exited")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    time.sleep(0.5)
EOF
  then
    CHILDREN=$($PY -c "import psutil; print(*(c.pid for c in psutil.Process($SERVE_PID).children(recursive=True)))")
    log "/health 200 (serve $SERVE_PID, children: $CHILDREN)"
    B="$PY benchmarks/serving.py --base-url http://127.0.0.1:$PORT --model $SERVED_NAME --dataset-name random"
    # Warm-up (not measured): two full-length prompts, as throughput.py warms its engine with two.
    timeout "$(cap 90)" $B --random-input-len "$IN_LEN" --random-output-len 8 --num-prompts 2 --max-concurrency 2 \
      --ignore-eos --seed 1 --save-result --result-dir "$WORK" --result-filename warmup.json >"$WORK/warmup.txt" 2>&1
    if $PY -c "import json, sys; m = json.load(open('$WORK/warmup.json')); sys.exit(m['completed'] != 2)" 2>/dev/null; then
      log "warm-up done; benchmark: $NUM_PROMPTS prompts, in $IN_LEN, out $OUT_LEN, concurrency $CONCURRENCY"
      timeout "$(cap 240)" $B --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --max-concurrency "$CONCURRENCY" --ignore-eos --save-result --result-dir "$OUT" --result-filename w1_serving.json \
        && SERVING_OK=1 || log "FAILED: serving benchmark (exit $?)"
    else
      log "FAILED: warm-up requests did not complete:"; cat "$WORK/warmup.txt"
    fi
  else
    log "FAILED: the server did not answer /health 200"
  fi
  log "stopping the server"
  cleanup_serve_start=$SECONDS
  cleanup
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
print(json.dumps(summary, indent=1))
(out / "w1_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
log "done"; ls -la "$OUT"
