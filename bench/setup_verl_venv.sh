#!/usr/bin/env bash
# Build .bench-venv: verl's FSDP model merger, CPU-only, for the side-by-side benchmark.
# Kept apart from .venv so verl's pins never touch the project's environment.
# Idempotent: does nothing once the stamp file exists and the pins below are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.bench-venv
PIP="$VENV/bin/python -m pip"
# torch is pinned on every pip line: unpinned, a resolver may pull a multi-GB CUDA build.
TORCH="torch==2.13.0"
# verl==0.9.1's own requirements list wandb, datasets, ray[default], ... that the merger never
# imports, so verl goes in with --no-deps and only what `python -m verl.model_merger` imports is
# added, inside verl's declared ranges (tensordict<=0.10.0, transformers<5.11). The last four are
# what verl's own FSDPCheckpointManager imports (bench/verl_interop.py saves with it); xxhash and
# zlib-ng are shardstream's own, so that it also merges under the transformers verl's merger used.
DEPS=(
    "ray==2.60.0"
    "tensordict==0.10.0"
    "transformers==5.10.4"
    "accelerate==1.16.0"
    "omegaconf==2.4.0"
    "safetensors==0.8.0"
    "numpy"
    "tqdm"
    "psutil"
    "peft==0.21.2"
    "datasets==5.2.0"
    "pillow==13.0.0"
    "codetiming==1.4.0"
    "xxhash==4.1.0"
    "zlib-ng==1.1.0"
)
PINS="verl==0.9.1 $TORCH ${DEPS[*]}"
STAMP="$VENV/.bench-installed"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PINS" ]]; then
    exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
$PIP install --quiet --upgrade pip
$PIP install --quiet "$TORCH"
$PIP install --quiet --no-deps verl==0.9.1
$PIP install --quiet "$TORCH" "${DEPS[@]}"
# Fail here, not in the middle of a benchmark, if the merger cannot even start.
"$VENV/bin/python" -m verl.model_merger merge --help >/dev/null
"$VENV/bin/python" -c "import verl.utils.checkpoint.fsdp_checkpoint_manager"
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"CUDA build of torch in .bench-venv: {torch.version.cuda}"
PY
echo "$PINS" >"$STAMP"
echo "bench: $VENV ready ($PINS)"
