"""A shardstream manifest's values have the types docs/format.md gives them, or the step is
refused naming manifest.json, by verify, inspect and merge alike: a shape of "37" was read as
[3, 7] and one of [3.5, 7] as [3, 7], offsets and sizes alike; world_size 2**40 and
files_complete "yes" passed (the latter skipping the check for added files); a chunk naming a
same-shaped optimizer state's record was merged as the weight; step -5 passed inspect and merge.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardstream
from shardstream import cli
from shardstream.formats import native


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A step of a two-layer model and its Adam state (exp_avg has the weights' shapes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    step = tmp_path_factory.mktemp("saved") / "global_step_3"
    shardstream.save(step, model=model, optimizer=optimizer, step=3)
    return step


def _reseal(step: Path, mutate: Callable[[dict], None]) -> None:
    """Edit the manifest and write it back canonical with a fresh checksum, grid entries
    spelled out as the chunk lists they stand for (so cases can edit chunks)."""
    doc = json.loads((step / native.MANIFEST).read_bytes())
    doc.pop("checksum")
    for fqn, tensor in doc["tensors"].items():
        if "grid" in tensor:
            tensor["chunks"] = list(native.grid_chunks(fqn, tensor["shape"], tensor.pop("grid")))
    mutate(doc)
    native.write_manifest(step, doc)


def _entry(name: str, **values) -> Callable[[dict], None]:
    return lambda doc: doc["tensors"][name].update(values)


def _chunk(name: str, **values) -> Callable[[dict], None]:
    return lambda doc: doc["tensors"][name]["chunks"][0].update(values)


def _top(**values) -> Callable[[dict], None]:
    return lambda doc: doc.update(values)


W0, W1 = "model.0.weight", "model.1.weight"  # [4, 8] and [1, 4]
# case -> (edit, what the one error line names besides manifest.json)
BAD = {
    "shape a string": (_entry(W1, shape="14"), (W1, "shape '14'")),
    "shape a float": (_entry(W0, shape=[4.5, 8]), (W0, "shape [4.5, 8]")),
    "shape a whole float": (_entry(W0, shape=[4.0, 8]), (W0, "shape [4.0, 8]")),
    "shape a bool": (_entry(W1, shape=[True, 4]), (W1, "shape [True, 4]")),
    "shape negative": (_entry(W0, shape=[-4, 8]), (W0, "shape [-4, 8]")),
    "offsets a string": (_chunk(W0, offsets="00"), (W0, "offsets '00'")),
    "offsets bools": (_chunk(W0, offsets=[False, False]), (W0, "offsets [False, False]")),
    "offsets a float": (_chunk(W0, offsets=[0.0, 0]), (W0, "offsets [0.0, 0]")),
    "offsets negative": (_chunk(W0, offsets=[-1, 0]), (W0, "offsets [-1, 0]")),
    "sizes a string": (_chunk(W1, sizes="14"), (W1, "sizes '14'")),
    "sizes a bool": (_chunk(W1, sizes=[True, 4]), (W1, "sizes [True, 4]")),
    "sizes a float": (_chunk(W0, sizes=[4.0, 8]), (W0, "sizes [4.0, 8]")),
    "world_size 2**40": (_top(world_size=2**40), ("world_size 1099511627776",)),
    "world_size past the bound": (
        _top(world_size=native.MAX_WORLD_SIZE + 1),
        (f"world_size {native.MAX_WORLD_SIZE + 1}",),
    ),
    "files_complete 'yes'": (_top(files_complete="yes"), ("files_complete is 'yes'",)),
    "files_complete 1": (_top(files_complete=1), ("files_complete is 1",)),
    # docs/format.md: `true`, optional; no writer ever wrote false.
    "files_complete false": (_top(files_complete=False), ("files_complete is False",)),
    "key of a same-shaped optimizer state": (
        _chunk(W0, key="optimizer.state.0.weight.exp_avg@0,0"),
        (W0, "'optimizer.state.0.weight.exp_avg@0,0'", "'model.0.weight@0,0'"),
    ),
    "key of other offsets": (_chunk(W1, key=f"{W1}@1,0"), (W1, f"'{W1}@1,0'")),
    "step -5": (_top(step=-5), ("step -5",)),
}


def _cli(capsys, *argv) -> tuple[int, list[str], str]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()], err


def _copy(saved: Path, tmp_path: Path) -> Path:
    step = tmp_path / "run" / saved.name
    shutil.copytree(saved, step)
    return step


@pytest.mark.parametrize("case", sorted(BAD))
def test_manifest_value_of_the_wrong_type_is_refused_by_every_command(
    saved, tmp_path, capsys, case
):
    edit, needles = BAD[case]
    step = _copy(saved, tmp_path)
    _reseal(step, edit)
    target = tmp_path / "merged"
    runs = {
        "verify": ("verify", "--quiet", step),
        "inspect": ("inspect", step),
        "merge": ("merge", "--local_dir", step, "--target_dir", target, "--quiet"),
    }
    for command, argv in runs.items():
        code, lines, err = _cli(capsys, *argv)
        assert code != 0, (command, lines)
        assert "Traceback" not in err, (command, err)
        assert len(lines) == 1, (command, lines)
        line = lines[0]
        if command != "verify":  # verify prints "<path>: <problem>", one line per problem
            assert line.startswith(f"shardstream {command}: error: "), line
        for needle in (str(step / native.MANIFEST), *needles):
            assert needle in line, (command, needle, line)
    assert not target.exists()


@pytest.mark.parametrize("spelled_out", [False, True], ids=["as saved", "grids as chunk lists"])
def test_a_good_manifest_still_verifies_inspects_and_merges(saved, tmp_path, capsys, spelled_out):
    """The writer's own keys and types pass, grid entries spelled out as chunk lists too."""
    step = _copy(saved, tmp_path)
    if spelled_out:
        _reseal(step, lambda doc: None)
    assert _cli(capsys, "verify", "--quiet", step)[:2] == (0, [])
    assert _cli(capsys, "inspect", step)[:2] == (0, [])
    target = tmp_path / "merged"
    assert _cli(capsys, "merge", "--local_dir", step, "--target_dir", target, "--quiet")[:2] == (
        0,
        [],
    )
    assert (target / "model.safetensors").is_file()
