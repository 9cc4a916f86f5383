#!/usr/bin/env bash
# One device call on the H200: consistency checks, W1 throughput of Tessera, and the transformers peer.
# Needs in the working tree (git-ignored, carried): .gpucache/qwen2.5-{0.5b,7b} made by
#   python -c "from inference.model_loader import resolve_model as r; print(r('qwen2.5-7b', load_format='dummy').model_dir)"
# (copied there), and peer/ = a copy of ../shared/peer. Results land in $OUT and are copied to benchmarks/results/.
set -u
export PYTHONUNBUFFERED=1 TESSERA_CACHE_DIR=/tmp/tessera-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 170 python3 benchmarks/gpu_check.py --model .gpucache/qwen2.5-0.5b --output-json "$OUT/gpu_check.json" 2>&1 | grep -v "^INFO" | tail -20
timeout 200 python3 benchmarks/throughput.py --model .gpucache/qwen2.5-7b --load-format dummy --dtype bfloat16 \
  --num-prompts 256 --input-len 1024 --output-len 512 --max-model-len 2048 --max-num-batched-tokens 8192 \
  --peer none --output-json "$OUT/w1_tessera.json" 2>&1 | tail -20
(cd peer && OUT="$OUT" timeout 200 python3 hf_peer.py --models qwen7b --n 64 --inlen 1024 --outlen 512 2>&1 | tail -12)
ls -la "$OUT"
