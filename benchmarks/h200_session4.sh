#!/usr/bin/env bash
# Fourth H200 session (2 GPUs: nvidia-h200-x2), one call per part, machine kept warm in between:
#   bash benchmarks/h200_session4.sh tp      tensor parallelism: TP=1 vs TP=2 greedy tokens + W1 side by side
#   bash benchmarks/h200_session4.sh quant   W4A16/FP8 decode latency vs bf16, FP8 W1 vs bf16, FP8 perplexity
#   bash benchmarks/h200_session4.sh w1peer  W1 (async scheduling) and the transformers peer in the same call
#   bash benchmarks/h200_session4.sh w3      W3 latency (50 x 1000 in / 2000 out, median TPOT)
# Carried, git-ignored: .gpucache (dummy model dirs), peer/ (a copy of ../shared/peer).
set -u
export PYTHONUNBUFFERED=1 TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
quiet() { grep -v -e tokenizer -e "^INFO" -e Warn -e _warn; }
case "${1:-}" in
tp)
  timeout 560 python3 benchmarks/tensor_parallel.py --model .gpucache/qwen2.5-7b --output-json "$OUT/tensor_parallel.json" 2>&1 | quiet | tail -30 ;;
quant)
  timeout 300 python3 benchmarks/quantization.py --model .gpucache/qwen2.5-7b --skip-throughput --decode-steps 32 \
    --output-json "$OUT/quantization.json" 2>&1 | quiet | tail -30
  cd benchmarks   # W1 bf16 and FP8, each in a process of its own
  for q in "" "--quantization fp8"; do
    timeout 120 python3 throughput.py --load-format dummy --dtype bfloat16 --peer none --model ../.gpucache/qwen2.5-7b \
      --workload peer-w1 --num-prompts 256 --input-len 1024 --output-len 512 --max-model-len 2048 \
      --max-num-batched-tokens 16384 $q --output-json "$OUT/w1${q// /}.json" 2>&1 | quiet
  done
  cd ..
  timeout 150 python3 benchmarks/perplexity.py --dtype bfloat16 --methods none fp8 --output-json "$OUT/perplexity.json" 2>&1 | quiet | tail -6 ;;
w1peer)
  cd benchmarks
  timeout 120 python3 throughput.py --load-format dummy --dtype bfloat16 --peer none --model ../.gpucache/qwen2.5-7b \
    --workload peer-w1 --num-prompts 256 --input-len 1024 --output-len 512 --max-model-len 2048 \
    --max-num-batched-tokens 16384 --output-json "$OUT/w1.json" 2>&1 | quiet
  cd ../peer && OUT="$OUT" timeout 200 python3 hf_peer.py --models qwen7b --n 64 --inlen 1024 --outlen 512 2>&1 | tail -6 ;;
w3)
  timeout 200 python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none --model .gpucache/qwen2.5-7b \
    --num-prompts 50 --input-len 1000 --output-len 2000 --max-model-len 3072 --max-num-seqs 64 \
    --output-json "$OUT/w3.json" 2>&1 | quiet | tail -6 ;;
*) echo "usage: $0 tp|quant|w1peer|w3"; exit 2 ;;
esac
ls "$OUT"
