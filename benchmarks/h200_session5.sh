#!/usr/bin/env bash
# H200 device calls (sessions 4-7): the steps named on the command line, in order, in one call, e.g.
#   bash benchmarks/h200_session5.sh tp-small tp quant-decode       (nvidia-h200-x2: the TP steps need 2 GPUs)
# Steps:
#   tp-small  TP=1 vs TP=2 on the Qwen2.5-0.5B shape: a few greedy requests + a short W1 (does TP run at all)
#   tp        TP=1 vs TP=2 on the Qwen2.5-7B shape: greedy tokens (float32) + W1 side by side
#   tp-fp8    TP=1 vs TP=2 with --quantization fp8 on the Qwen2.5-7B shape: greedy tokens
#   tp-awq    the same with AWQ (random 4-bit codes) in float16
#   quant-decode  W4A16/FP8 decode step latency vs bf16 (Qwen2.5-7B shape, batch 1-32), kernel microbenchmarks
#   quant-sweep   the same for bf16 and AWQ with a grid of W4A16 decode-kernel configs per shape
#   quant-kernels the kernel microbenchmarks alone with the sweep (chunk/tile kernels x wgmma/mma.sync), no steps
#   w1, w1-fp8    W1 (Qwen2.5-7B shape, 256 x 1024 in / 512 out) in bf16, and with --quantization fp8
#   peer-w1   the transformers peer on W1 (64 prompts: generate_batch, then generate in batches of 64)
#   w2, peer-w2   W2 (nano-vllm's workload, Qwen2.5-0.5B shape) on Tessera, and on the transformers peer
#   w3        W3 latency (50 x 1000 in / 2000 out, median TPOT)
#   check32   prefix caching on/off and swap vs recompute in float32 (gpu_check)
#   check-ms  multi-step (8) vs single decode steps, float32 and bfloat16 (gpu_check)
#   w2-ms     W2 with --num-scheduler-steps 1 4 8 (one engine each, same workload)
#   w2-n4-stepwise  W2 (4 scheduler steps) with its windows launched step by step, not as one CUDA graph each
#   w2-n8     W2 with --num-scheduler-steps 8
#   w2-n8-trace   the same with --step-trace (wall and device-wait seconds by batch size)
#   w2-n8-prof    W2 with 8 scheduler steps: kernel table and device timeline over 16 windows
#   w2-small-prof the same with 16 of W2's prompts (small batches: is the host or the device the limit)
#   w2-n8-phases  W2 (8 steps) with --step-trace and --phase-timers (host seconds per step phase)
#   w2-n16-trace  W2 with 16 scheduler steps and --step-trace
#   w2-n8-stepwise-trace  W2 (8 steps, windows launched step by step) with --step-trace
#   w2-n4     W2 with --num-scheduler-steps 4 only (w2-n4-delta: its requests ask for every step's deltas)
#   w2-n4-repeat  W2 with 4 scheduler steps three times on one engine, with the Triton builds in each timed run
#   silu-fp8  the FP8 SwiGLU kernel reading its row once against the two-pass one (benchmarks/kernels.py)
#   w2-split2 / w2-split8   W2 (N=1, 4) with the decode attention's KV splits aimed at 2 / 8 programs per SM
#   w3-split8 W3 with 8 programs per SM (the default from session 6; session 5's W3 ran with 2)
#   gpu-kernels   the attention, layer and FP8 GEMM kernel tests and the Triton-backend engine test on the GPU
#   kernels-s12   kernels.py's fused rotary + KV store case
#   w2-n8-old     w2-n8 on the code copied into .old/ (git archive of the commit to compare against)
#   decode-layouts  the decode attention at 256/128/32/16 rows over block sizes 16/32/64, token- and head-major
#                 blocks, and the merge kernel's heads per program
#   gemm-blas     W2's GEMMs through cuBLAS and cuBLASLt (torch's preferred_blas_library), 16-256 rows
#   (session 14's -norope steps ran W2 with --no-rope-in-decode-kernel, on branch wip/rope-in-decode)
#   gpu-s14       the decode kernel, argmax and window-graph tests on the GPU
#   launch-floor  microseconds a launch of kernels that do nothing, replayed from a CUDA graph (chains of 16, 264)
#   w2-floor      W2's model (8 scheduler steps) at 1, 16 and 64 requests of 100 in / 1,024 out: the step time
#                 and roofline fraction when the batch is small (the per-step floor of the kernel chain)
#   decode-quick  decode-sweep's neighbourhood of the defaults only
#   decode-sweep  the decode attention's splits / keys per iteration / warps / stages at W2's shape (256, 128 rows)
#   gemm-sweep    W2's bf16 GEMMs: cuBLAS against the Triton split-K GEMM's grid at 64-256 rows
#   w2-n4-prof  the same with 4 scheduler steps (32 windows), with the device's busy fraction and idle gaps
#   w2-prof   W2's kernel table over 32 decode steps once all 256 are admitted (torch profiler)
#   fp8-layouts   torch._scaled_mm in both operand orders vs bf16, per linear shape and row count
#   fp8-triton-sweep  the Triton FP8 GEMM's tile/split grid against torch._scaled_mm, 16-256 rows
#   fp8-triton-wide   the same at 256 rows with larger tiles and 3 or 4 stages
#   gpu-fp8   the FP8 and fused-layer kernel tests on the GPU (pytest, CUDA shapes)
#   gpu-w4a16 the W4A16 kernel and AWQ/GPTQ format tests on the GPU
#   w1-prof, w1-fp8-prof   W1's kernel table over 16 decode steps once all 256 are admitted, bf16 / fp8
#   w1-fp8-prof-prefill    W1 fp8's kernel table over its first 4 steps (16,384-token prefill chunks)
# Each step logs to $OUT/<step>.log (Python stacks dumped there if it runs past its limit: SIGABRT +
# PYTHONFAULTHANDLER) and writes its JSON under $OUT; leftovers of a step are killed before the next.
#   ppl-fp8   perplexity of the packaged SmolLM2 unquantized vs FP8 (the GGUF, 98 MB, is over one call's
#             carry limit: it travels in two parts: step stash-a with .devcarry/a carried copies part a to
#             /tmp, then ppl-fp8 in the next call, at once while the machine is warm, with .devcarry/b)
# Carried, git-ignored: .devcarry/smollm2-tok (SmolLM2's tokenizer files, for the tiny-model engine tests),
# .gpucache (dummy model dirs; or .devcarry/*/gpucache.tar.xz, unpacked here),
# peer/ (a copy of ../shared/peer).
set -u
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: some steps run in .old/
M7=.gpucache/qwen2.5-7b
W1="--load-format dummy --dtype bfloat16 --peer none --workload peer-w1 --num-prompts 256 --input-len 1024
    --output-len 512 --max-model-len 2048 --max-num-batched-tokens 16384"

for t in .devcarry/*/gpucache.tar.xz; do [ -d .gpucache/qwen2.5-7b ] || tar -xJf "$t"; done
run_step() {  # NAME LIMIT_S COMMAND...: one step, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T) | GPU MiB used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | tr '\n' ' ')"
  timeout -s ABRT -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(date +%T)"
  grep -v -e tokenizer -e "^INFO" -e Warn -e _warn "$OUT/$name.log" | tail -n 25
  echo "== $name: NCCL teardown given up $(grep -c 'did not return within' "$OUT/$name.log") time(s)"
  # anchored at the interpreter: a calling shell whose command line names a benchmark script survives
  pkill -9 -f "^python3 (benchmarks/[a-z_0-9]*\.py|hf_peer)|multiprocessing.spawn" 2>/dev/null; sleep 2
}

for step in "$@"; do
  case "$step" in
  tp-small) run_step tp-small 150 python3 benchmarks/tensor_parallel.py --model .gpucache/qwen2.5-0.5b \
      --check-prompts 4 --check-tokens 16 --num-prompts 64 --input-len 256 --output-len 64 \
      --output-json "$OUT/tensor_parallel_small.json" ;;
  tp) run_step tp 420 python3 benchmarks/tensor_parallel.py --model $M7 --check-prompts 8 --check-tokens 32 \
      --output-json "$OUT/tensor_parallel.json" ;;
  tp-fp8) run_step tp-fp8 180 python3 benchmarks/tensor_parallel.py --model $M7 --quantization fp8 --check-prompts 8 \
      --check-tokens 32 --check-dtype bfloat16 --skip-throughput --unquantized-reference --output-json "$OUT/tensor_parallel_fp8.json" ;;
  tp-awq) run_step tp-awq 180 python3 benchmarks/tensor_parallel.py --model $M7 --quantization awq --check-prompts 8 \
      --check-tokens 32 --check-dtype float16 --skip-throughput --output-json "$OUT/tensor_parallel_awq.json" ;;
  quant-decode) run_step quant-decode 240 python3 benchmarks/quantization.py --model $M7 --skip-throughput \
      --decode-steps 32 --output-json "$OUT/quantization.json" ;;
  quant-kernels) run_step quant-kernels 480 python3 benchmarks/quant_kernels.py --model $M7 --sweep \
      --output-json "$OUT/quant_kernels_sweep.json" ;;
  quant-sweep) run_step quant-sweep 420 python3 benchmarks/quantization.py --model $M7 --skip-throughput --sweep \
      --methods bf16 awq --decode-steps 32 --output-json "$OUT/quantization_sweep.json" ;;
  w1) run_step w1 130 python3 benchmarks/throughput.py $W1 --model $M7 --output-json "$OUT/w1.json" ;;
  w1-fp8) run_step w1-fp8 130 python3 benchmarks/throughput.py $W1 --model $M7 --quantization fp8 \
      --output-json "$OUT/w1_fp8.json" ;;
  fp8-triton-sweep) run_step fp8-triton-sweep 400 python3 benchmarks/fp8_gemm_layouts.py --model $M7 --triton-sweep \
      --no-layouts --batch-sizes 16 64 128 256 --output-json "$OUT/fp8_gemm_triton_sweep.json" ;;
  fp8-triton-wide) run_step fp8-triton-wide 400 python3 benchmarks/fp8_gemm_layouts.py --model $M7 --triton-sweep \
      --wide-grid --no-layouts --batch-sizes 256 --output-json "$OUT/fp8_gemm_triton_wide.json" ;;
  fp8-layouts) run_step fp8-layouts 200 python3 benchmarks/fp8_gemm_layouts.py --model $M7 \
      --output-json "$OUT/fp8_gemm_layouts.json" ;;
  stash-a) cp .devcarry/a/gguf.partaa /tmp/gguf.partaa && ls -la /tmp/gguf.partaa ;;  # for ppl-fp8 in the next call
  ppl-fp8)
    cat /tmp/gguf.partaa .devcarry/b/gguf.partab .devcarry/b/gguf.partac > /tmp/smollm2.gguf \
      && sha256sum /tmp/smollm2.gguf | cut -c1-16 \
      && run_step ppl-fp8 150 python3 benchmarks/perplexity.py --model /tmp/smollm2.gguf --dtype bfloat16 \
        --methods none fp8 --output-json "$OUT/perplexity_fp8.json" ;;
  peer-w1) (cd peer && OUT="$OUT" run_step peer-w1 220 python3 hf_peer.py --models qwen7b --n 64 --inlen 1024 \
      --outlen 512) ;;
  w2) run_step w2 120 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none \
      --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --output-json "$OUT/w2.json" ;;
  peer-w2) (cd peer && OUT="$OUT" run_step peer-w2 300 python3 hf_peer_w2.py qwen0.5b) ;;
  w3) run_step w3 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none --model $M7 \
      --num-prompts 50 --input-len 1000 --output-len 2000 --max-model-len 3072 --max-num-seqs 64 \
      --output-json "$OUT/w3.json" ;;
  check-ms) run_step check-ms 200 python3 benchmarks/gpu_check.py --model .gpucache/qwen2.5-0.5b --dtype float32 \
      --checks multistep async --num-prompts 32 --output-json "$OUT/gpu_check_multistep_fp32.json" ;;
  w2-ms) run_step w2-ms 300 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none \
      --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 1 4 8 --output-json "$OUT/w2_multistep.json" ;;
  w2-n4-delta) run_step w2-n4-delta 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 4 --output-kind delta --output-json "$OUT/w2_n4_delta.json" ;;
  w2-n4-repeat) run_step w2-n4-repeat 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 4 --repeat 3 --output-json "$OUT/w2_n4_repeat.json" ;;
  silu-fp8) run_step silu-fp8 200 python3 benchmarks/kernels.py --only silu --out "$OUT/kernels_silu_fp8.json" ;;
  w2-n4-stepwise) run_step w2-n4-stepwise 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 4 --no-window-graphs --output-json "$OUT/w2_n4_stepwise.json" ;;
  w2-n8) run_step w2-n8 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none \
      --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 8 --output-json "$OUT/w2_n8.json" ;;
  w2-n8-trace) run_step w2-n8-trace 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 8 --step-trace --output-json "$OUT/w2_n8_trace.json" ;;
  w2-n8-prof) run_step $step 200 python3 benchmarks/throughput.py --load-format dummy \
      --dtype bfloat16 --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 \
      --max-model-len 2048 --max-num-batched-tokens 16384 --num-scheduler-steps 8 --profile-steps 16 \
      --output-json "$OUT/${step//-/_}.json" ;;
  w2-small-prof) run_step $step 200 python3 benchmarks/throughput.py --load-format dummy \
      --dtype bfloat16 --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-prompts 16 --num-scheduler-steps 8 --profile-steps 12 \
      --output-json "$OUT/${step//-/_}.json" ;;
  w2-n8-phases) run_step w2-n8-phases 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-prompts 256 \
      --num-scheduler-steps 8 --step-trace --phase-timers --output-json "$OUT/w2_n8_phases.json" ;;
  w2-n16-trace) run_step w2-n16-trace 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-prompts 256 \
      --num-scheduler-steps 16 --step-trace --output-json "$OUT/w2_n16_trace.json" ;;
  w2-n8-stepwise-trace) run_step w2-n8-stepwise-trace 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-prompts 256 \
      --num-scheduler-steps 8 --no-window-graphs --step-trace --output-json "$OUT/w2_n8_stepwise_trace.json" ;;
  w2-n4) run_step w2-n4 150 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none \
      --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 4 --output-json "$OUT/w2_n4.json" ;;
  w2-split2|w2-split8) run_step $step 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 1 4 --decode-programs-per-sm ${step#w2-split} \
      --output-json "$OUT/$step.json" ;;
  w3-split8) run_step w3-split8 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none \
      --model $M7 --num-prompts 50 --input-len 1000 --output-len 2000 --max-model-len 3072 --max-num-seqs 64 \
      --decode-programs-per-sm 8 --output-json "$OUT/w3_split8.json" ;;
  gpu-kernels) TESSERA_TEST_TOKENIZER=.devcarry/smollm2-tok run_step gpu-kernels 300 python3 -m pytest -q -p no:cacheprovider tests/inference/test_triton_kernels.py \
      tests/inference/test_triton_fp8_gemm.py tests/inference/test_triton_fp8.py tests/inference/test_window_graph.py \
      tests/inference/test_triton_backend_engine.py ;;
  w2-n8-old) [ -d .old ] || { echo "w2-n8-old: no .old/ (git archive the commit to compare into it)"; continue; }
    (cd .old && run_step w2-n8-old 150 python3 benchmarks/throughput.py --load-format dummy \
      --dtype bfloat16 --peer none --model ../.gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 \
      --max-model-len 2048 --max-num-batched-tokens 16384 --num-scheduler-steps 8 --output-json "$OUT/w2_n8_old.json") ;;
  decode-layouts) run_step decode-layouts 240 python3 benchmarks/decode_sweep.py --model .gpucache/qwen2.5-0.5b \
      --batch-sizes 256 128 32 16 --grid none --block-sizes 16 32 64 --layouts token head \
      --output-json "$OUT/decode_layouts.json" ;;
  gemm-blas) run_step gemm-blas 200 python3 benchmarks/gemm_sweep.py --model .gpucache/qwen2.5-0.5b --no-triton \
      --blas-libraries cublaslt --batch-sizes 16 64 128 256 --output-json "$OUT/gemm_blas.json" ;;
  gpu-s14) TESSERA_TEST_TOKENIZER=.devcarry/smollm2-tok run_step gpu-s14 300 python3 -m pytest -q -p no:cacheprovider \
      tests/inference/test_triton_kernels.py tests/inference/test_triton_argmax.py tests/inference/test_window_graph.py \
      tests/inference/test_triton_backend_engine.py -k "decode or argmax or window or sampled or capture or transformers" ;;
  launch-floor) run_step launch-floor 120 python3 benchmarks/launch_floor.py --output-json "$OUT/launch_floor.json" ;;
  w2-floor) for b in 1 16 64; do run_step w2-floor-$b 120 python3 benchmarks/throughput.py --load-format dummy \
      --dtype bfloat16 --peer none --model .gpucache/qwen2.5-0.5b --num-prompts $b --input-len 100 --output-len 1024 \
      --max-model-len 2048 --num-scheduler-steps 8 --output-json "$OUT/w2_floor_$b.json"; done ;;
  kernels-s12) run_step kernels-s12 120 python3 benchmarks/kernels.py --only rotary_store \
      --out "$OUT/kernels_s12.json" ;;
  decode-quick) run_step decode-quick 120 python3 benchmarks/decode_sweep.py --model .gpucache/qwen2.5-0.5b \
      --batch-sizes 256 128 --grid quick --output-json "$OUT/decode_quick.json" ;;
  decode-sweep) run_step decode-sweep 240 python3 benchmarks/decode_sweep.py --model .gpucache/qwen2.5-0.5b \
      --batch-sizes 256 128 --output-json "$OUT/decode_sweep.json" ;;
  gemm-sweep) run_step gemm-sweep 300 python3 benchmarks/gemm_sweep.py --model .gpucache/qwen2.5-0.5b \
      --batch-sizes 64 128 256 --output-json "$OUT/gemm_sweep.json" ;;
  w2-n4-prof) run_step w2-n4-prof 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 \
      --peer none --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --num-scheduler-steps 4 --profile-steps 32 --output-json "$OUT/w2_n4_profile.json" ;;
  w2-prof) run_step w2-prof 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none \
      --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
      --max-num-batched-tokens 16384 --profile-steps 32 --output-json "$OUT/w2_profile.json" ;;
  check32) run_step check32 150 python3 benchmarks/gpu_check.py --model .gpucache/qwen2.5-0.5b --dtype float32 \
      --checks prefix swap --num-prompts 16 --output-json "$OUT/gpu_check_fp32.json" ;;
  gpu-w4a16) run_step gpu-w4a16 240 python3 -m pytest -q -p no:cacheprovider tests/inference/test_triton_w4a16.py \
      tests/inference/test_quantization_formats.py -k "w4a16 or decode or awq or gptq" ;;
  gpu-fp8) run_step gpu-fp8 300 python3 -m pytest -q -p no:cacheprovider tests/inference/test_triton_fp8.py \
      tests/inference/test_triton_fp8_gemm.py tests/inference/test_quantization_formats.py \
      tests/inference/test_triton_kernels.py -k "fp8 or rms or silu" ;;
  w1-prof) run_step w1-prof 200 python3 benchmarks/throughput.py $W1 --model $M7 --profile-steps 16 \
      --output-json "$OUT/w1_profile.json" ;;
  w1-fp8-prof) run_step w1-fp8-prof 200 python3 benchmarks/throughput.py $W1 --model $M7 --quantization fp8 \
      --profile-steps 16 --output-json "$OUT/w1_fp8_profile.json" ;;
  w1-fp8-prof-prefill) run_step w1-fp8-prof-prefill 200 python3 benchmarks/throughput.py $W1 --model $M7 \
      --quantization fp8 --profile-steps 4 --profile-phase prefill --output-json "$OUT/w1_fp8_profile_prefill.json" ;;
  *) echo "unknown step $step (see the header of $0)"; exit 2 ;;
  esac
done
ls "$OUT"
