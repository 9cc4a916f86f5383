#!/usr/bin/env bash
# Sourced by the serving steps of benchmarks/gpu/run.sh (serving.sh, tenants.sh): installs the
# carried web-stack wheels (.gpuserve/whl, built by `make gpu-pack`), starts the carried redis-server
# (REDIS_URL), migrates a fresh database (TESSERA_DB_PATH) and defines start_serve / stop_serve / cleanup. Reads
# BUDGET, PY, WHEELS, REDIS_BIN, OUT from the environment; the trap on EXIT stops everything and keeps serve.log.
T0=${T0:-$SECONDS}
BUDGET=${BUDGET:-500}
PY=${PY:-python3}
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
stop_serve() {   # serve stops Daphne, then the workers (SIGTERM, then SIGKILL after 15 s each)
  if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -TERM "$SERVE_PID"
    for _ in $(seq 90); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVE_PID" 2>/dev/null && { log "serve did not stop in 45 s: SIGKILL"; kill -KILL "$SERVE_PID"; }
  fi
  for pid in $CHILDREN; do kill -0 "$pid" 2>/dev/null && { log "child $pid still alive: SIGKILL"; kill -KILL "$pid"; }; done
  SERVE_PID=""; CHILDREN=""
}
cleanup() {
  stop_serve
  if [ -n "$RPID" ] && kill -0 "$RPID" 2>/dev/null; then
    kill -TERM "$RPID"; for _ in $(seq 20); do kill -0 "$RPID" 2>/dev/null || break; sleep 0.25; done
  fi
  RPID=""
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

timeout "$(cap 60)" $PY manage.py migrate --noinput -v 0 && log "migrated $TESSERA_DB_PATH"

# start_serve MODEL SERVED_NAME FLAGS...: manage.py serve on a free port (PORT), waits up to 240 s for /health 200.
start_serve() {
  local model=$1 name=$2; shift 2
  PORT=$(free_port)
  log "serve $model as '$name' on port $PORT: $*"
  $PY manage.py serve "$model" --served-model-name "$name" --host 127.0.0.1 --port "$PORT" "$@" \
    --log-level warning >>"$WORK/serve.log" 2>&1 &
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
    return 0
  fi
  log "FAILED: the server did not answer /health 200"; tail -25 "$WORK/serve.log"
  return 1
}
