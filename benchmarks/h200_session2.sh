#!/usr/bin/env bash
# Second H200 call: W1 (two prefill budgets), W2, W3 on Tessera, and the W2 transformers peer, in one call.
# Carried, git-ignored: .gpucache/qwen2.5-{0.5b,7b} (dummy model dirs, see h200_session.sh) and peer/ (../shared/peer).
set -u
export PYTHONUNBUFFERED=1 TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none"
timeout 120 $B --model .gpucache/qwen2.5-7b --workload peer-w1 --num-prompts 256 --input-len 1024 --output-len 512 \
  --max-model-len 2048 --max-num-batched-tokens 16384 --output-json "$OUT/w1_16k.json" 2>&1 | grep -v tokenizer
timeout 90 $B --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
  --max-num-batched-tokens 16384 --output-json "$OUT/w2.json" 2>&1 | grep -v tokenizer
timeout 120 $B --model .gpucache/qwen2.5-7b --num-prompts 50 --input-len 1000 --output-len 2000 --max-model-len 3072 \
  --max-num-seqs 64 --output-json "$OUT/w3.json" 2>&1 | grep -v tokenizer
(cd peer && OUT="$OUT" timeout 330 python3 hf_peer_w2.py qwen0.5b 2>&1 | tail -8)
ls "$OUT"
