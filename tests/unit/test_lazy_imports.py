"""Start-up stays light: the package and the CLI import torch only when a command needs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


HEAVY = ("torch", "numpy", "torch.distributed.checkpoint", "torch.distributed.tensor")


def test_import_and_cli_help_import_no_torch():
    out = run_python(
        "import sys, contextlib, io\n"
        "import shardstream\n"
        "from shardstream.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['merge', '--help'])\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert out == "[]"


@pytest.mark.parametrize(
    "first", ["import shardstream.commands.merge", "import shardstream.commands.verify", ""]
)
def test_public_api_names_the_functions(first):
    out = run_python(
        f"{first}\n"
        "import shardstream\n"
        "from shardstream import CheckpointConfig, CheckpointManager, load, save, merge, verify\n"
        "from shardstream import MergeSummary, UsageError\n"
        "import inspect\n"
        "print(inspect.isfunction(merge), inspect.isfunction(verify),\n"
        "      shardstream.merge is merge, shardstream.verify is verify,\n"
        "      inspect.isclass(CheckpointManager), 'merge' in dir(shardstream))"
    )
    assert out == "True True True True True True"


def test_unknown_attribute_is_an_attribute_error():
    import shardstream

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        shardstream.nope  # noqa: B018


def test_verl_checkpoint_detection_skips_dcp_modules(tmp_path):
    """Detecting a verl checkpoint imports neither DCP's reader nor torch.distributed.checkpoint;
    detecting any directory imports no torch."""
    (tmp_path / "model_world_size_1_rank_0.pt").write_bytes(b"not a zip")
    out = run_python(
        "import sys, shardstream.formats.source\n"
        f"print(shardstream.formats.source.detect({str(tmp_path)!r}).name,\n"
        "      'torch' in sys.modules, end=' ')\n"
        "try:\n"
        f"    shardstream.formats.source.open_checkpoint({str(tmp_path)!r})\n"
        "except shardstream.CheckpointFormatError as exc:\n"
        "    print('corrupt' in str(exc), end=' ')\n"
        "print('shardstream.formats.dcp' in sys.modules,\n"
        "      'torch.distributed.checkpoint' in sys.modules)"
    )
    assert out == "VERL False True False False"


def test_verify_and_inspect_of_shardstream_checkpoints_import_no_torch(tmp_path):
    """Reading shardstream's own format is JSON, safetensors headers and hashing: the two
    commands that do only that start in a fraction of a second instead of importing torch."""
    import torch

    import shardstream

    shardstream.save(tmp_path / "step", model=torch.nn.Linear(8, 4), contents=("model",))
    out = run_python(
        "import sys, contextlib, io\n"
        "from shardstream.cli import main\n"
        "codes = []\n"
        f"for argv in (['verify', {str(tmp_path / 'step')!r}, '--quiet'],\n"
        f"             ['inspect', {str(tmp_path / 'step')!r}]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as text:\n"
        "        codes.append(main(argv))\n"
        "    assert 'weight' in text.getvalue() or argv[0] == 'verify', text.getvalue()\n"
        f"print(codes, sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert out == "[0, 0] []"


def test_torch_free_dtype_tables_match_torch():
    from shardstream.engine import dtypes

    assert set(dtypes.ITEMSIZE) == set(dtypes.TORCH_NAME) == set(dtypes.TORCH_BY_CODE)
    for code, dtype in dtypes.TORCH_BY_CODE.items():
        assert dtypes.ITEMSIZE[code] == dtype.itemsize, code
        assert dtypes.TORCH_NAME[code] == str(dtype).removeprefix("torch."), code
        assert dtypes.code_of(dtype) == code and dtypes.CODE_BY_TORCH[dtype] == code
