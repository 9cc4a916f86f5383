#!/usr/bin/env bash
# Builds .gpuserve/ (git-ignored), what benchmarks/h200_serving.sh carries to the lent H200, whose image has
# Python 3.12 and no Django, Channels, Celery, Twisted or Redis: the web stack's wheels for CPython 3.12
# (.gpuserve/whl), the newer copies of packages the image has in older versions (.gpuserve/whl-ifold, installed
# there only where needed), and this machine's redis-server with its libraries (.gpuserve/redis: lib/ those the
# image lacks, lib-extra/ the rest, taken only where missing). Run from the repository root, where pip reaches
# PyPI. Session 15 (2026-12-02): 35 MB; Debian 12's redis-server 7.0.15 ran on the image.
set -eu
rm -rf .gpuserve /tmp/gpuserve-dl
mkdir -p .gpuserve/whl .gpuserve/whl-ifold .gpuserve/redis/lib .gpuserve/redis/lib-extra
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d /tmp/gpuserve-dl \
  $(awk '/^# Web application/ {on = 1; next} on && /^#/ {exit} on && NF' requirements.txt)
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
grep -qx '/.gpuserve/' .git/info/exclude 2>/dev/null || echo '/.gpuserve/' >>.git/info/exclude
du -sh .gpuserve
