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

.PHONY: demo test lint gpu-test clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

demo: $(VENV)/.installed-$(EXTRAS)
	$(VENV)/bin/python -m models.generate $(DEMO_ARGS)

lint: $(VENV)/.installed-$(EXTRAS)
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(TEST_ARGS)

gpu-test: $(VENV)/.installed-$(EXTRAS)
	$(VENV)/bin/python -m pytest -q -m gpu $(TEST_ARGS)

clean:
	rm -rf $(VENV)
