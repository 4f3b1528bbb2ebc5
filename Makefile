# Two entry points for users: `make demo` and `make test`. Everything lives in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardstream-installed

.PHONY: demo test lint format bench soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so no resolver ever pulls a multi-GB CUDA build.
	# GPU users: install your own torch build into .venv before running make.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m shardstream.demo

test: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

format: $(STAMP)
	$(PY) -m ruff format src tests bench
	$(PY) -m ruff check --fix src tests bench

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py

soak: $(STAMP)
	$(PY) -m pytest -q tests -m soak --soak

clean:
	rm -rf $(VENV) .bench-venv build dist src/*.egg-info .pytest_cache
