#!/usr/bin/env bash
# The GPU benchmarks and tests: runs the steps named on the command line, in order, e.g.
#   make gpu-pack                              # here: builds .gpucache/ and .gpuserve/ (carry both to the host)
#   bash benchmarks/gpu/run.sh table           # on an H200 host: every figure of the performance table
#   bash benchmarks/gpu/run.sh w1 w3 gpu-tests
# Run from the repository root with a Python that has torch, triton and transformers (PY, default python3).
#
# Steps (one GPU unless said otherwise):
#   check            CUDA graphs vs eager, Triton vs the PyTorch reference, async vs sync steps (gpu_check.py)
#   gpu-tests        the Triton kernel tests at real shapes and dtypes: attention, argmax, window graphs, FP8,
#                    W4A16, fused layers and the Triton-backend engine against transformers (pytest)
#   lora-tests       the LoRA kernels against their reference, and the engine with adapters (CUDA graphs, Triton
#                    kernels) against transformers + peft on a tiny model (pytest; needs .gpuserve/whl-test)
#   w1               W1: Qwen2.5-7B shape, bf16, 256 prompts x 1024 in / 512 out (throughput.py)
#   w1-fp8           W1 with --quantization fp8
#   w2               W2: Qwen2.5-0.5B shape, nano-vllm's workload (256 x U[100, 1024] in and out), at default
#                    flags (engine-sized decode windows), twice (_r1, _r2: the run-to-run spread), then with
#                    --num-scheduler-steps 8 (fixed windows)
#   w2-floor         W2's model with 1, 16 and 64 requests of 100 in / 1,024 out (the per-step floor)
#   w3               W3: Qwen2.5-7B shape, 50 x 1000 in / 2000 out, median TPOT
#   lora             W1 without LoRA, then over 8 rank-16 adapters (all in every batch); decode steps at batch 64
#                    with and without them (lora_throughput.py)
#   lora-profile     the kernel table of 16 decode steps of 64 requests over 8 rank-16 adapters
#   kv-fp8-w3        the W3 half of kv-fp8
#   kv-fp8           W3 and W1 with the KV cache in bf16 (auto) and FP8 (--kv-cache-dtype fp8), alternating
#   prefix-cost      W1 and W2 with prefix caching off and on (the default), alternating: its cost at a 0% hit rate
#                    (with --step-trace: where the wall time went, by batch size); workloads PC_WORKLOADS (default
#                    "w1 w2")
#   prefix-ttft      Qwen2.5-7B shape: 256 requests at once sharing a 1,024-token system prompt, TTFT with prefix
#                    caching off and on (prefix_caching.py --workloads batch)
#   late-requests    W2 at default flags, 16 requests of 128 in / 16 out arriving one every 0.25 s while it runs,
#                    then into the idle engine: their TTFT, the decode windows, the wait for the step boundary
#                    (late_requests.py)
#   late-profile     the same with 4 late requests, the third's calls from hand-over to first token under the torch
#                    profiler (--profile-late 2): where a late request's TTFT goes
#   window-target    engine-sized decode windows of at most WT ms (default 25) against the default (12): the late requests,
#                    then W2 with each, alternating, rounds WT_ROUNDS (default "a b") (--window-target-ms)
#   gemm-sweep-w3    W3's decode GEMMs (Qwen2.5-7B shape, 50 rows): cuBLAS, cuBLASLt and the Triton split-K grid
#                    (gemm_sweep.py)
#   window-clock     W2 at default flags with windows sized by each launch's device time (the default) and by the wall
#                    time between launches (--window-clock wall), alternating, rounds WC_ROUNDS (default "a b")
#   window-host      W2 with engine-sized windows at least 1.25 times the host's time per iteration on the device
#                    (--window-host-cover 1.25) and at default flags (the latency target alone), alternating, rounds
#                    WH_ROUNDS (default "a b"); then the late requests with it
#   w4a16-split-k    the W4A16 decode kernel's K split on gate_up and down at 1, 16 and 64 rows (w4a16_split_k.py)
#   w4a16-tile-sweep the W4A16 tile kernel's tile width, warps, stages and K split on the 7B shape's four layers at
#                    TS_ROWS rows (default "32 64"), against the default config and bf16 (w4a16_tile_sweep.py)
#   blas             W3, W1 and W2 with the dense layers through cuBLAS and through cuBLASLt
#                    (torch.backends.cuda.preferred_blas_library), alternating, rounds BLAS_ROUNDS (default "a"),
#                    workloads BLAS_WORKLOADS (default "w3 w1 w2")
#   blas-choice      W3 and W2 at default flags (each dense layer's captured GEMMs through cuBLAS or cuBLASLt, as timed at
#                    start-up) and with every GEMM on cuBLAS (--no-blas-choice), alternating, rounds BC_ROUNDS (default
#                    "a b"), workloads BC_WORKLOADS (default "w3 w2")
#   baseline         W3 and W2 at default flags from this tree and from an earlier commit's tree, alternating, rounds
#                    BASE_ROUNDS (default "a b"): issue 26's goals on a card where its baselines were not taken. W3's
#                    baseline is BASE_W3 (default 8de9955, whose median TPOT of 6.56 ms on an H200 is the goal), W2's
#                    BASE_W2 (default dc3bd59, the tree when the issue measured 41,479 tok/s at default flags). Each
#                    tree is .gpucache/base-COMMIT (git archive COMMIT inference benchmarks | tar -x -C that folder).
#                    BASE_WORKLOADS=w4a16-decode: AWQ and bf16 decode steps at batch 1/8/16 against BASE_W4 (default
#                    149753d, the W4A16 launch configs before gate_up ran unsplit)
#   window-lengths   W2 at default flags with window graphs for every engine-sized window length (2, 4, 8 steps; the
#                    default) and for the longest only (--window-graphs-longest-only), alternating, rounds WL_ROUNDS
#                    (default "a b")
#   piecewise        the piecewise-graph tests, then the late requests, W2 and W1 with steps that compute prompt tokens
#                    eager (--no-piecewise-graphs) and as piecewise CUDA graphs (the default), alternating, rounds
#                    PW_ROUNDS (default "a")
#   quantization     decode-step latency of bf16, AWQ, GPTQ and FP8 at batch 1/8/32, then W1 bf16 and FP8
#                    in both orders (pairs a and b)
#   kernels          the kernel microbenchmarks (kernel_bench.py) and the launch floor of a CUDA graph (launch_floor.py)
#   w4a16            the W4A16 paths (decode kernel, GEMM kernel, dequantize + cuBLAS) checked in fp16 and bf16 and
#                    timed against bf16 on the Qwen2.5-7B linear shapes at 1-2,048 rows, with a few decode-kernel
#                    configs (w4a16_sweep.py; about 3-4 minutes on a fresh machine)
#   w4a16-decode     decode-step latency (per token) of bf16 and AWQ on the Qwen2.5-7B shape at batch 1/8/16/32/64
#                    (issue goals: >= 2.2x bf16 at 1-16, >= 1.5x at 32/64)
#   w4a16-decode-gemv  the same at batch 1/2/4, bf16 against AWQ through the MMA decode kernel and through the
#                    CUDA-core GEMV kernel (awq-gemv), in one run
#   awq-seed         the seed's workload (50 x 1,024 in / 512 out, Qwen2.5-7B shape) in float16, then AWQ
#   w4a16-profile    kernel tables of 16 decode steps of bf16 and AWQ at batch 1 and 16: where the step goes
#   w1-profile       W1's and W1 FP8's kernel tables over 16 decode steps (torch profiler)
#   w3-decode-sweep  the decode attention kernel's launch grid (splits, keys per iteration, warps, stages) at W3's
#                    point (50 requests of 1,500-2,500 tokens), bf16 and FP8 caches (decode_sweep.py)
#   w3-profile       W3's kernel table over 16 decode steps with the KV cache in bf16 (auto), then FP8: where FP8's
#                    saving goes
#   w2-profile       W2's kernel table over 16 windows of 8 steps, with the device's busy fraction
#   serving          W1 through `manage.py serve` (its default `--api-server-count`: 4 on 16 cores) and benchmarks/serving.py, then the offline
#                    engine on the same workload (serving.sh; needs .gpuserve)
#   structured-output  W2's workload with a JSON schema on every request (4 schemas) against none, grammar
#                    compile times, a new schema's TTFT (structured_output.py; needs .gpuserve/whl-engine)
#   tenants          GPU shares of tenants at 30% / 70% through the server (tenants.sh; needs .gpuserve)
#   tensor-parallel  2 GPUs: TP=1 vs TP=2 on the Qwen2.5-7B shape (greedy tokens in float32, then W1), and the
#                    same token check with AWQ and FP8 weights
#   table            check w1 w2 w3 quantization serving (the performance table on one H200)
#
# On a lent device machine, where only a few files come back, run with OUT=/tmp/res and pack /tmp/res into one
# archive in the machine's own output folder at the end.
# Each step logs to $OUT/<step>.log (Python stacks dumped there if it runs past its limit) and writes its
# results to $OUT (default /tmp/out) named <workload>_<device>_<date>[_<run>].json, each stamped with the
# commit measured (git, or .gpucache/COMMIT) and the step that reproduces it. Copy them to
# benchmarks/results/ and run `python benchmarks/results_index.py`.
set -u
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-/tmp/tessera-cache}
export TESSERA_LOGGING_LEVEL=${TESSERA_LOGGING_LEVEL:-WARNING}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
DATE=$(date -u +%F)
# .gpucache/COMMIT first: a copy of the tree on the host may carry a git repository of its own
COMMIT=$(cat .gpucache/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export TESSERA_COMMIT=$COMMIT  # the commit the benchmarks stamp (benchmarks/provenance.py)
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
# the card's model ("NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200), else the name's last word
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{for (i = 1; i <= NF; i++)
  if (tolower($i) ~ /^[a-z][0-9]+$/) { print tolower($i); exit } print tolower($NF)}')
GPU=${GPU:-cpu}
M05=.gpucache/qwen2.5-0.5b
M7=.gpucache/qwen2.5-7b
TP="$PY benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none"
W1="--model $M7 --workload peer-w1 --num-prompts 256 --input-len 1024 --output-len 512 --max-model-len 2048
    --max-num-batched-tokens 16384"
W2="--model $M05 --workload peer-w2 --num-prompts 256 --max-model-len 2048 --max-num-batched-tokens 16384"
W3="--model $M7 --num-prompts 50 --input-len 1000 --output-len 2000 --max-model-len 3072 --max-num-seqs 64"

for m in $M05 $M7; do
  [ -d "$m" ] || { echo "missing $m: run 'make gpu-pack' and carry .gpucache/ with the tree"; exit 2; }
done

# run_step NAME LIMIT_S COMMAND...: one step, its output in $OUT/NAME.log; what is left of it is killed after.
run_step() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T)"
  timeout -s ABRT -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(date +%T)"
  grep -v -e tokenizer -e "^INFO" -e Warn -e _warn "$OUT/$name.log" | tail -n 25
  # anchored at the interpreter, so that the shell running this script survives
  pkill -9 -f "^$PY (benchmarks/[a-z_0-9]*\.py)|multiprocessing.spawn" 2>/dev/null; sleep 2
  return $rc
}

# stamp STEP: add commit and step to the step's new result files (those without a "reproduce").
stamp() {
  $PY - "$OUT" "$1" "$COMMIT" <<'EOF'
import json, sys
from pathlib import Path
out, step, commit = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
for path in sorted(out.glob("*.json")):
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "reproduce" not in data:
        data.setdefault("commit", commit)
        data["reproduce"] = f"bash benchmarks/gpu/run.sh {step}"
        path.write_text(json.dumps(data, indent=1) + "\n")
EOF
}

name() { echo "$OUT/$1_${GPU}${2:-}_${DATE}${3:-}.json"; }  # name WORKLOAD [DEVICE_SUFFIX] [RUN_SUFFIX]

step_serving() {
  OUT=$OUT/serving BUDGET=${BUDGET:-560} PY=$PY bash benchmarks/gpu/serving.sh
  [ -f "$OUT/serving/w1_summary.json" ] && $PY - "$OUT/serving/w1_summary.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
d["command"] = ("benchmarks/serving.py --dataset-name random --random-input-len 1024 --random-output-len 512 "
                "--num-prompts 256 --max-concurrency 256 --ignore-eos against manage.py serve --load-format dummy "
                "--dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 "
                "(default --api-server-count); then benchmarks/throughput.py on the same workload")
json.dump(d, open(sys.argv[1], "w"), indent=1)
EOF
  for f in summary:serving-w1 serving:serving-w1-client offline:serving-w1-offline; do
    [ -f "$OUT/serving/w1_${f%%:*}.json" ] && mv "$OUT/serving/w1_${f%%:*}.json" "$(name "${f#*:}")"
  done
}

for step in "$@"; do
  case "$step" in
  table) exec "$0" check w1 w2 w3 quantization serving ;;
  check) run_step check 200 $PY benchmarks/gpu_check.py --model $M05 --output-json "$(name gpu-check)" ;;
  gpu-tests) TESSERA_TEST_TOKENIZER=.gpucache/smollm2-tok run_step gpu-tests 500 $PY -m pytest -q -p no:cacheprovider \
      tests/inference/test_triton_kernels.py tests/inference/test_triton_argmax.py tests/inference/test_window_graph.py \
      tests/inference/test_triton_fp8.py tests/inference/test_triton_fp8_gemm.py tests/inference/test_triton_w4a16.py \
      tests/inference/test_quantization_formats.py tests/inference/test_triton_backend_engine.py \
      tests/inference/test_triton_bitmask.py tests/inference/test_triton_fp8_kv.py tests/inference/test_piecewise_graph.py \
      tests/inference/test_blas_choice.py
    cp "$OUT/gpu-tests.log" "$OUT/gpu-tests_${GPU}_${DATE}.log" ;;
  lora-tests)
    $PY -m pip install -q --no-index --no-deps --target /tmp/site-test .gpuserve/whl-test/*.whl
    PYTHONPATH=/tmp/site-test${PYTHONPATH:+:$PYTHONPATH} TESSERA_TEST_TOKENIZER=.gpucache/smollm2-tok \
      run_step lora-tests 300 $PY -m pytest -q -p no:cacheprovider tests/inference/test_triton_lora.py \
      tests/inference/test_lora_device.py
    cp "$OUT/lora-tests.log" "$OUT/lora-tests_${GPU}_${DATE}.log" ;;
  w1) run_step w1 200 $TP $W1 --output-json "$(name w1)" ;;
  w1-fp8) run_step w1-fp8 200 $TP $W1 --quantization fp8 --output-json "$(name w1-fp8)" ;;
  w2) for r in 1 2; do run_step w2-r$r 200 $TP $W2 --output-json "$(name w2 "" _r$r)"; done
    run_step w2-steps8 200 $TP $W2 --num-scheduler-steps 8 --output-json "$(name w2-steps8)" ;;
  w2-floor) for b in 1 16 64; do run_step w2-floor-$b 150 $TP --model $M05 --num-prompts $b --input-len 100 \
      --output-len 1024 --max-model-len 2048 --num-scheduler-steps 8 --output-json "$(name w2-floor-$b)"; done ;;
  w3) run_step w3 300 $TP $W3 --output-json "$(name w3)" ;;
  lora) run_step lora 560 $PY benchmarks/lora_throughput.py --load-format dummy --dtype bfloat16 $W1 --num-adapters 8 \
      --lora-rank 16 --output-json "$(name lora-w1)" ;;
  lora-profile) run_step lora-profile 250 $PY benchmarks/lora_throughput.py --load-format dummy --dtype bfloat16 $W1 \
      --num-adapters 8 --lora-rank 16 --profile-only --profile-steps 16 --output-json "$(name lora-kernel-profile)" ;;
  kv-fp8-w3)
    run_step w3-kv-auto 300 $TP $W3 --output-json "$(name w3-kv-auto)"
    run_step w3-kv-fp8 300 $TP $W3 --kv-cache-dtype fp8 --output-json "$(name w3-kv-fp8)" ;;
  kv-fp8)
    run_step w3-kv-auto 300 $TP $W3 --output-json "$(name w3-kv-auto)"
    run_step w3-kv-fp8 300 $TP $W3 --kv-cache-dtype fp8 --output-json "$(name w3-kv-fp8)"
    run_step w1-kv-fp8 200 $TP $W1 --kv-cache-dtype fp8 --output-json "$(name w1-kv-fp8)"
    run_step w1-kv-auto 200 $TP $W1 --output-json "$(name w1-kv-auto)" ;;
  prefix-cost)
    for w in ${PC_WORKLOADS:-w1 w2}; do
      case $w in w1) flags=$W1 ;; *) flags=$W2 ;; esac
      for r in a b; do
        run_step $w-nopc-$r 200 $TP $flags --step-trace --no-enable-prefix-caching \
          --output-json "$(name $w-prefix-off "" _$r)"
        run_step $w-pc-$r 200 $TP $flags --step-trace --output-json "$(name $w-prefix-on "" _$r)"
      done
    done ;;
  prefix-ttft) run_step prefix-ttft 360 $PY benchmarks/prefix_caching.py --model $M7 --load-format dummy \
      --dtype bfloat16 --workloads batch --num-prompts 256 --system-len 1024 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --output-json "$(name prefix-ttft)" ;;
  late-requests) run_step late-requests 200 $PY benchmarks/late_requests.py --load-format dummy --dtype bfloat16 $W2 \
      --num-late 16 --late-input-len 128 --late-output-len 16 --late-interval 0.25 --output-json "$(name late-requests)" ;;
  late-profile) run_step late-profile 200 $PY benchmarks/late_requests.py --load-format dummy --dtype bfloat16 $W2 \
      --num-late 4 --late-input-len 128 --late-output-len 16 --late-interval 0.25 --profile-late 2 \
      --output-json "$(name late-requests-profile)" ;;
  gemm-sweep-w3) run_step gemm-sweep-w3 400 $PY benchmarks/gemm_sweep.py --model $M7 --batch-sizes 50 \
      --blas-libraries cublaslt --output-json "$(name gemm-sweep-w3)" ;;
  window-clock)
    for r in ${WC_ROUNDS:-a b}; do
      run_step w2-wc-device-$r 200 $TP $W2 --output-json "$(name w2-window-clock-device "" _$r)"
      run_step w2-wc-wall-$r 200 $TP $W2 --window-clock wall --output-json "$(name w2-window-clock-wall "" _$r)"
    done ;;
  window-host)
    for r in ${WH_ROUNDS:-a b}; do
      run_step w2-wh-on-$r 200 $TP $W2 --window-host-cover 1.25 --output-json "$(name w2-window-host-cover "" _$r)"
      run_step w2-wh-off-$r 200 $TP $W2 --output-json "$(name w2-window-host-cover-off "" _$r)"
    done
    run_step late-requests-wh 200 $PY benchmarks/late_requests.py --load-format dummy --dtype bfloat16 $W2 \
      --num-late 16 --late-input-len 128 --late-output-len 16 --late-interval 0.25 --window-host-cover 1.25 \
      --output-json "$(name late-requests-window-host-cover)" ;;
  w4a16-split-k) run_step w4a16-split-k 300 $PY benchmarks/w4a16_split_k.py --output-json "$(name w4a16-split-k)" ;;
  w4a16-tile-sweep) run_step w4a16-tile-sweep 480 $PY benchmarks/w4a16_tile_sweep.py --rows ${TS_ROWS:-32 64} \
      --output-json "$(name w4a16-tile-sweep)" ;;
  blas)
    for r in ${BLAS_ROUNDS:-a}; do
      for w in ${BLAS_WORKLOADS:-w3 w1 w2}; do
        case $w in w1) flags=$W1 ;; w2) flags=$W2 ;; *) flags=$W3 ;; esac
        run_step $w-cublas-$r 300 $TP $flags --blas-library cublas --output-json "$(name $w-cublas "" _$r)"
        run_step $w-cublaslt-$r 300 $TP $flags --blas-library cublaslt --output-json "$(name $w-cublaslt "" _$r)"
      done
    done ;;
  blas-choice)
    for r in ${BC_ROUNDS:-a b}; do
      for w in ${BC_WORKLOADS:-w3 w2}; do
        case $w in w1) flags=$W1 ;; w2) flags=$W2 ;; *) flags=$W3 ;; esac
        run_step $w-bc-on-$r 300 $TP $flags --output-json "$(name $w-blas-choice "" _$r)"
        run_step $w-bc-off-$r 300 $TP $flags --no-blas-choice --output-json "$(name $w-blas-choice-off "" _$r)"
      done
    done ;;
  baseline)
    for r in ${BASE_ROUNDS:-a b}; do
      for w in ${BASE_WORKLOADS:-w3 w2}; do
        case $w in
          w2) cmd="$TP $W2" base=${BASE_W2:-dc3bd59} ;;
          w4a16-decode) cmd="$PY benchmarks/quantization.py --model $M7 --methods bf16 awq --batch-sizes 1 8 16
            --skip-kernels --skip-throughput --decode-steps 64" base=${BASE_W4:-149753d} ;;
          *) cmd="$TP $W3" base=${BASE_W3:-8de9955} ;;
        esac
        bdir=.gpucache/base-$base
        [ -d "$bdir" ] || { echo "missing $bdir: git archive $base inference benchmarks | tar -x -C $bdir"; exit 2; }
        mkdir -p "$bdir/.gpucache"
        for d in qwen2.5-0.5b qwen2.5-7b; do ln -sfn "$PWD/.gpucache/$d" "$bdir/.gpucache/$d"; done
        (cd "$bdir" && TESSERA_CACHE_DIR=/tmp/tessera-cache-$base run_step $w-base-$r 300 $cmd \
          --output-json "$(name $w-commit-$base "" _$r)")
        $PY - "$(name $w-commit-$base "" _$r)" "$base" <<'EOF'
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
if path.exists():  # the earlier tree does not stamp its commit
    data = json.loads(path.read_text())
    data["commit"] = sys.argv[2]
    path.write_text(json.dumps(data, indent=1) + "\n")
EOF
        run_step $w-head-$r 300 $cmd --output-json "$(name $w "" _$r)"
      done
    done ;;
  window-lengths)
    for r in ${WL_ROUNDS:-a b}; do
      run_step w2-wl-all-$r 200 $TP $W2 --output-json "$(name w2-window-graphs-all "" _$r)"
      run_step w2-wl-longest-$r 200 $TP $W2 --window-graphs-longest-only --output-json "$(name w2-window-graphs-longest "" _$r)"
    done ;;
  window-target)
    WT=${WT:-25}
    DEF=$($PY -c "from inference.sched.decode_windows import WINDOW_TARGET_S as t; print(round(1e3 * t))")
    run_step late-requests-wt$WT 200 $PY benchmarks/late_requests.py --load-format dummy --dtype bfloat16 $W2 \
      --num-late 16 --late-input-len 128 --late-output-len 16 --late-interval 0.25 --window-target-ms $WT \
      --output-json "$(name late-requests-window-${WT}ms)"
    for r in ${WT_ROUNDS:-a b}; do
      run_step w2-$r 200 $TP $W2 --output-json "$(name w2-window-${DEF}ms "" _$r)"
      run_step w2-wt$WT-$r 200 $TP $W2 --window-target-ms $WT --output-json "$(name w2-window-${WT}ms "" _$r)"
    done ;;
  piecewise)
    TESSERA_TEST_TOKENIZER=.gpucache/smollm2-tok run_step piecewise-tests 200 $PY -m pytest -q -p no:cacheprovider \
      tests/inference/test_piecewise_graph.py
    for r in ${PW_ROUNDS:-a}; do
      run_step late-requests-eager-$r 200 $PY benchmarks/late_requests.py --load-format dummy --dtype bfloat16 $W2 \
        --num-late 16 --late-input-len 128 --late-output-len 16 --late-interval 0.25 --no-piecewise-graphs \
        --output-json "$(name late-requests-no-piecewise "" _$r)"
      run_step late-requests-$r 200 $PY benchmarks/late_requests.py --load-format dummy --dtype bfloat16 $W2 \
        --num-late 16 --late-input-len 128 --late-output-len 16 --late-interval 0.25 \
        --output-json "$(name late-requests-piecewise "" _$r)"
      run_step w2-eager-$r 200 $TP $W2 --no-piecewise-graphs --output-json "$(name w2-no-piecewise "" _$r)"
      run_step w2-$r 200 $TP $W2 --output-json "$(name w2-piecewise "" _$r)"
      run_step w1-eager-$r 200 $TP $W1 --no-piecewise-graphs --output-json "$(name w1-no-piecewise "" _$r)"
      run_step w1-$r 200 $TP $W1 --output-json "$(name w1-piecewise "" _$r)"
    done ;;
  quantization)
    run_step quant-decode 300 $PY benchmarks/quantization.py --model $M7 --skip-throughput --decode-steps 32 \
      --output-json "$(name decode-quantized)"
    run_step w1-fp8-a 200 $TP $W1 --quantization fp8 --output-json "$(name w1-fp8 "" _a)"
    run_step w1-a 200 $TP $W1 --output-json "$(name w1 "" _a)"
    run_step w1-b 200 $TP $W1 --output-json "$(name w1 "" _b)"
    run_step w1-fp8-b 200 $TP $W1 --quantization fp8 --output-json "$(name w1-fp8 "" _b)" ;;
  kernels)
    run_step kernels 300 $PY benchmarks/kernel_bench.py --out "$(name kernels)"
    run_step launch-floor 120 $PY benchmarks/launch_floor.py --output-json "$(name launch-floor)" ;;
  w4a16-decode) run_step w4a16-decode 300 $PY benchmarks/quantization.py --model $M7 --methods bf16 awq \
      --batch-sizes 1 8 16 32 64 --skip-kernels --skip-throughput --decode-steps 64 \
      --output-json "$(name decode-w4a16 "" ${RUN_SUFFIX:-})" ;;
  w4a16-decode-gemv) run_step w4a16-decode-gemv 300 $PY benchmarks/quantization.py --model $M7 \
      --methods bf16 awq awq-gemv --batch-sizes 1 2 4 --skip-kernels --skip-throughput --decode-steps 64 \
      --output-json "$(name decode-w4a16-gemv)" ;;
  awq-seed)  # the seed's workload: 50 requests of 1,024 in / 512 out, float16 weights then AWQ (issue goal >= 1.4x)
    for q in float16 awq; do
      run_step seed-$q 200 $PY benchmarks/throughput.py --load-format dummy --peer none --model $M7 --num-prompts 50 \
        --input-len 1024 --output-len 512 --max-model-len 2048 --dtype float16 \
        $([ $q = awq ] && echo --quantization awq) --output-json "$(name seed-$q)"
    done ;;
  w4a16-profile)
    for q in bf16 awq; do for b in 1 16; do
      run_step w4a16-profile-$q-$b 200 $TP --model $M7 --num-prompts $b --input-len 128 --output-len 512 \
        --max-model-len 1024 $([ $q = awq ] && echo --quantization awq) --profile-steps 16 \
        --output-json "$(name decode-kernel-profile-$q-b$b)"
    done; done ;;
  w4a16) run_step w4a16 360 $PY benchmarks/w4a16_sweep.py --output-json "$(name w4a16-sweep)" ;;
  w1-profile)
    run_step w1-profile 250 $TP $W1 --profile-steps 16 --output-json "$(name w1-kernel-profile)"
    run_step w1-fp8-profile 250 $TP $W1 --quantization fp8 --profile-steps 16 --output-json "$(name w1-fp8-kernel-profile)" ;;
  w3-decode-sweep) run_step w3-decode-sweep 300 $PY benchmarks/decode_sweep.py --model .gpucache/qwen2.5-7b \
      --batch-sizes 50 --context-range 1500 2500 --max-seq-len 3072 --grid long --kv-cache-dtype auto fp8 \
      --output-json "$(name w3-decode-sweep)" ;;
  w3-profile)
    run_step w3-profile 250 $TP $W3 --profile-steps 16 --output-json "$(name w3-kernel-profile)"
    run_step w3-fp8-profile 250 $TP $W3 --kv-cache-dtype fp8 --profile-steps 16 \
      --output-json "$(name w3-kv-fp8-kernel-profile)" ;;
  w2-profile) run_step w2-profile 250 $TP $W2 --profile-steps 16 --output-json "$(name w2-kernel-profile)" ;;
  serving) step_serving ;;
  structured-output)
    $PY -m pip install -q --no-index --no-deps --target /tmp/site-engine .gpuserve/whl-engine/*.whl
    PYTHONPATH=/tmp/site-engine${PYTHONPATH:+:$PYTHONPATH} run_step structured-output 200 \
      $PY benchmarks/structured_output.py --model $M05 --load-format dummy --dtype bfloat16 --num-prompts 256 \
      --min-input 100 --max-input 1024 --output-len 1024 --max-model-len 2048 --output-json "$(name structured-output)" ;;
  tenants) OUT=$OUT BUDGET=${BUDGET:-560} PY=$PY RESULT="tenant-shares_${GPU}_${DATE}.json" bash benchmarks/gpu/tenants.sh ;;
  tensor-parallel)
    [ "$NGPU" -ge 2 ] || { echo "tensor-parallel needs 2 GPUs, this host has $NGPU"; continue; }
    run_step tp 500 $PY benchmarks/tensor_parallel.py --model $M7 --check-prompts 8 --check-tokens 32 \
      --output-json "$(name w1-tp2 x2)"
    run_step tp-awq 250 $PY benchmarks/tensor_parallel.py --model $M7 --quantization awq --check-prompts 8 \
      --check-tokens 32 --check-dtype float16 --skip-throughput --output-json "$(name tp2-awq-check x2)"
    run_step tp-fp8 250 $PY benchmarks/tensor_parallel.py --model $M7 --quantization fp8 --check-prompts 8 \
      --check-tokens 32 --check-dtype bfloat16 --skip-throughput --unquantized-reference \
      --output-json "$(name tp2-fp8-check x2)" ;;
  *) echo "unknown step $step (the steps are listed at the top of $0)"; exit 2 ;;
  esac
  stamp "$step"
done
ls "$OUT"
