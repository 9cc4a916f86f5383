#!/usr/bin/env bash
# Third H200 call (pipelined engine step): consistency checks, then W1/W2/W3 on Tessera and the
# transformers W1 peer in the same call. Carried, git-ignored: .gpucache/qwen2.5-{0.5b,7b}
# (dummy model dirs, see h200_session.sh) and peer/ (a copy of ../shared/peer).
set -u
export PYTHONUNBUFFERED=1 TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 150 python3 benchmarks/gpu_check.py --model .gpucache/qwen2.5-0.5b --output-json "$OUT/gpu_check.json" 2>&1 \
  | grep -v -e "^INFO" -e tokenizer | tail -6
B="python3 benchmarks/throughput.py --load-format dummy --dtype bfloat16 --peer none"
timeout 100 $B --model .gpucache/qwen2.5-7b --workload peer-w1 --num-prompts 256 --input-len 1024 --output-len 512 \
  --max-model-len 2048 --max-num-batched-tokens 16384 --output-json "$OUT/w1.json" 2>&1 | grep -v tokenizer | tail -4
timeout 80 $B --model .gpucache/qwen2.5-0.5b --workload peer-w2 --num-prompts 256 --max-model-len 2048 \
  --max-num-batched-tokens 16384 --output-json "$OUT/w2.json" 2>&1 | grep -v tokenizer | tail -4
timeout 100 $B --model .gpucache/qwen2.5-7b --num-prompts 50 --input-len 1000 --output-len 2000 --max-model-len 3072 \
  --max-num-seqs 64 --output-json "$OUT/w3.json" 2>&1 | grep -v tokenizer | tail -4
(cd peer && OUT="$OUT" timeout 150 python3 hf_peer.py --models qwen7b --n 64 --inlen 1024 --outlen 512 2>&1 | tail -6)
ls "$OUT"
