# Two entry points for users: `make demo` and `make test`. Everything lives in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardstream-installed
# torchtitan 0.3.0 for bench/titan_interop.py, with only what importing its trainer's parts
# needs; --no-deps so pip never touches torch (triton, which it imports undeclared, is an
# inert stub inside the script's processes).
TITAN_DEPS := torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0 tyro==1.0.17 \
	docstring-parser==0.18.0 typeguard==4.6.0 tensorboard==2.21.0 absl-py==2.5.1

.PHONY: demo test test-transformers4 lint format bench interop soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so no resolver ever pulls a multi-GB CUDA build.
	# GPU users: install your own torch build into .venv before running make.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps verl==0.9.1 && $(PY) -m pip install --quiet "torch==$$($(PY) -c 'import torch; print(torch.__version__)')" ray==2.60.0 tensordict==0.15.3 omegaconf==2.4.0 peft==0.21.2 accelerate==1.16.0 datasets==5.2.0 codetiming==1.4.0 orjson==3.13.0 pillow==13.0.0 uvicorn==0.55.0 fastapi==0.165.0 opentelemetry-api==1.45.3  # verl 0.9.1 for tests/integration/test_verl_plugin.py: what importing its FSDP engine and worker module needs, torch held
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m shardstream.demo

# Two pytest workers (pytest-xdist), each running whole test files, so a file's module
# fixtures are built once: about half the serial time on 2 cores.
test: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The save_pretrained-layout tests under transformers 4.57 (the suite runs 5.x), in a venv of
# their own: make test-transformers4 (about 2 minutes once installed).
TF4_VENV := .venv-transformers4
TF4_STAMP := $(TF4_VENV)/.shardstream-installed

$(TF4_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TF4_VENV)
	$(TF4_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TF4_VENV)/bin/python -c "import torch" 2>/dev/null || $(TF4_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(TF4_VENV)/bin/python -m pip install --quiet -e '.[test]' transformers==4.57.6
	touch $(TF4_STAMP)

test-transformers4: $(TF4_STAMP)
	$(TF4_VENV)/bin/python -m pytest -q -n 2 --dist loadfile tests/unit/test_tied_head.py \
		tests/unit/test_stored_head_names.py tests/integration/test_hf_layout.py \
		tests/integration/test_hf_layout_families.py

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

format: $(STAMP)
	$(PY) -m ruff format src tests bench
	$(PY) -m ruff check --fix src tests bench

# Benchmarks write docs/benchmarks*.md, docs/interop.md and docs/img/ (about 90 minutes on 2 cores).
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py
	$(PY) bench/moe_merge.py  # issue #22: a 2.5 GB Qwen3-MoE merge against a dense one; its section of docs/benchmarks.md
	$(PY) bench/moe_merge.py --source-cache evicted --no-reference  # the same, checkpoints read from disk
	$(PY) bench/distributed_merge_bench.py --ckpt bench/results/ckpt/qwen2-4gb-ws4/global_step_1/actor --repeats 1
	$(PY) bench/dcp_merge_bench.py
	$(PY) bench/wide_merge_bench.py
	$(PY) bench/save_bench.py --at-commit HEAD
	$(PY) bench/verl_interop.py
	$(PY) -m pip install --quiet --no-deps $(TITAN_DEPS)
	$(PY) bench/titan_interop.py
	$(PY) bench/verl_bench.py  # verl's FSDPCheckpointManager vs the plug-in's; docs/benchmarks-verl.md
	$(PY) bench/fsdp1_bench.py  # the same on FSDP1 (strategy: fsdp); its section of docs/benchmarks-verl.md

# verl 0.9.1's and torchtitan 0.3.0's own checkpoint managers save; verl's merger and
# shardstream merge and restore (bit for bit); writes docs/interop.md (about 5 minutes).
interop: $(STAMP)
	$(PY) bench/verl_interop.py
	$(PY) -m pip install --quiet --no-deps $(TITAN_DEPS)
	$(PY) bench/titan_interop.py

# Long reliability trials (kill -9, corruption, fuzzing); writes docs/reliability.md.
soak: $(STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) $(TF4_VENV) .bench-venv build dist src/*.egg-info .pytest_cache
