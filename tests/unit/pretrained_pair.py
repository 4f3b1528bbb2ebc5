"""A model's full in-memory state beside its config.json (what merge reads as a Hugging Face
directory), and what ``save_pretrained`` writes for the same weights: the pair the layout
tests compare merge's output against."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardstream import merge


def state_and_reference(
    tmp_path: Path, model, edit_config: Callable[[dict], None] | None = None
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """``state/`` (every name ``state_dict()`` gives, tied ones too, and config.json as
    save_pretrained wrote it, changed by ``edit_config``), ``reference/`` and the state."""
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    source = tmp_path / "state"
    source.mkdir()
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    if edit_config is not None:
        edit_config(config)
    (source / "config.json").write_text(json.dumps(config))
    return source, reference, state


def assert_merges_as_saved(source: Path, reference: Path, out: Path) -> None:
    """merge writes the tensors save_pretrained wrote: the same names, bit for bit."""
    merge(source, out)
    got, want = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
