"""Save with FSDP2 at one world size, restore at another: everything equal bit for bit."""

from __future__ import annotations

import pytest
import torch

from shardstream.testing.distributed import run

from . import workers

STEPS, AFTER = 3, 2
CONTENTS = ("model", "optimizer", "extra")


def assert_state_equal(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    want_state, got_state = want["optim"]["state"], got["optim"]["state"]
    assert got_state.keys() == want_state.keys()
    for name, entries in want_state.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(got_state[name][key]), torch.as_tensor(value)), (
                name,
                key,
            )
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert got["scheduler"] == want["scheduler"]


@pytest.fixture(scope="module", params=[("fsdp", 2), ("hsdp", 4)], ids=["fsdp2", "hsdp2x2"])
def saved(request, tmp_path_factory):
    layout, world = request.param
    root = str(tmp_path_factory.mktemp(f"run-{layout}"))
    results = run(workers.save_run, world, root, layout, STEPS, AFTER, CONTENTS)
    reference = torch.load(f"{root}/reference.pt", weights_only=False)
    return {
        "root": root,
        "layout": layout,
        "world": world,
        "results": results,
        "reference": reference,
    }


RESTORES = {
    "fsdp2": [("fsdp", 1), ("fsdp", 3), ("hsdp", 4)],
    "hsdp2x2": [("fsdp", 2), ("plain", 1), ("fsdp", 4)],
}


@pytest.mark.parametrize("index", [0, 1, 2])
def test_restore_at_other_world_sizes(saved, index):
    targets = RESTORES["fsdp2" if saved["layout"] == "fsdp" else "hsdp2x2"]
    layout, world = targets[index]
    results = run(workers.restore_run, world, saved["root"], layout, STEPS + 1, AFTER, CONTENTS)
    losses_after = saved["results"][0]["after"]
    for result in results:
        assert result["restored"][0] == STEPS
        assert result["restored"][1]["data"] == {"epoch": 1, "offset": STEPS * 7}
        assert_state_equal(result["state"], saved["reference"])
        # Continuing gives the same losses (bit-equal only when the sharding is the same).
        if (layout, world) == (saved["layout"], saved["world"]):
            assert result["after"] == losses_after
        else:
            assert result["after"] == pytest.approx(losses_after, rel=1e-5, abs=1e-6)
    # Only the last two steps are kept, and latest names the newest.
    assert saved["results"][0]["steps"] == [STEPS - 1, STEPS]


def test_same_world_size_continues_identically(saved):
    results = run(
        workers.restore_run,
        saved["world"],
        saved["root"],
        saved["layout"],
        STEPS + 1,
        AFTER,
        CONTENTS,
    )
    for rank, result in enumerate(results):
        assert_state_equal(result["state"], saved["reference"])
        assert result["after"] == saved["results"][rank]["after"]
    if saved["layout"] == "fsdp":
        # RNG is per rank: rank 0 continues exactly where the saving rank 0 stopped.
        assert torch.equal(results[0]["rng_next"], saved["reference"]["rng_next"])


def test_model_only_restore_leaves_optimizer_fresh(saved):
    results = run(workers.restore_run, 2, saved["root"], "fsdp", STEPS + 1, 0, ("model",))
    state = results[0]["state"]
    for name, tensor in saved["reference"]["model"].items():
        assert torch.equal(state["model"][name], tensor)
    # Reading the state for the comparison initialises it (zeros); nothing was loaded into it.
    for entries in state["optim"]["state"].values():
        assert not entries["exp_avg"].any() and not entries["exp_avg_sq"].any()
    assert results[0]["restored"][1] == {}
