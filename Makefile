# Two commands for a newcomer: `make demo` (the main job) and `make test` (lint + tests).
# Both create .venv with Python 3.12 when it is missing; on a machine with an NVIDIA GPU the
# CUDA build of jax is installed too.
PYTHON ?= $(shell command -v python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3.12)
VENV := .venv
EXTRAS := test$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)
DEMO_ARGS ?= --config tiny --prompt-len 100 --chunk-size 32 --max-new-tokens 16
TEST_ARGS ?=
# Test processes side by side (pytest-xdist), each test file in one of them: on CI's two cores
# the suite took 9-11 minutes against 14+ in one process, and no process accumulates every
# file's compiled programs (one process for the whole suite crashed inside XLA's CPU compiler
# near its end, session 10).
TEST_WORKERS ?= 2
# The suite's time on CPUs is mostly XLA compiling small programs once each. Two settings cut
# it (session 26): XLA's compiled programs kept on disk and shared by the test processes (the
# xdist workers and the subprocesses some tests start compile the same tiny decoder's steps),
# and LLVM's lowest level instead of 3 for them (session 26's level 1 compiled interpreted
# kernels 32% faster; level 0 took the engine's tests another 17%, session 28; tests compare
# programs compiled alike; `make demo` and the benchmarks keep the default).
TEST_CACHE ?= $(CURDIR)/build/jax-cache
TEST_ENV = JAX_COMPILATION_CACHE_DIR=$(TEST_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.25 \
	XLA_FLAGS="--xla_backend_optimization_level=0 $(XLA_FLAGS)"

# A second environment for the tests that compile the decode step for an H200 on a machine
# without one (`probes.deviceless`, tests/test_deviceless.py): JAX with the CUDA PJRT plugin
# but none of the NVIDIA libraries (~1 GB, not 4.5). Apart from .venv, where JAX would try
# the plugin's GPU backend in every process and print its failure.
DEVICELESS := build/deviceless

.PHONY: demo test lint gpu-test clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

$(DEVICELESS)/.installed: constraints.txt
	test -x $(DEVICELESS)/bin/python || $(PYTHON) -m venv $(DEVICELESS)
	$(DEVICELESS)/bin/python -m pip install -q -c constraints.txt jax jaxlib flax numpy \
		safetensors tokenizers
	$(DEVICELESS)/bin/python -m pip install -q -c constraints.txt --no-deps jax-cuda13-plugin \
		jax-cuda13-pjrt
	touch $@

demo: $(VENV)/.installed-$(EXTRAS)
	$(VENV)/bin/python -m models.generate $(DEMO_ARGS)

lint: $(VENV)/.installed-$(EXTRAS)
	$(VENV)/bin/ruff check .

test: lint $(DEVICELESS)/.installed
	$(TEST_ENV) JAXPAGED_DEVICELESS_PYTHON=$(CURDIR)/$(DEVICELESS)/bin/python $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_ARGS)

gpu-test: $(VENV)/.installed-$(EXTRAS)
	$(VENV)/bin/python -m pytest -q -m gpu $(TEST_ARGS)

clean:
	rm -rf $(VENV) $(DEVICELESS)
