"""``state.create_optimizer_state``: state for chosen parameters only, nothing else touched."""

from __future__ import annotations

import pytest
import torch

from shardstream.training import state as st


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].requires_grad_(False)  # frozen: torch's own initialisation skips it
    return model


ADAM_KINDS = {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    ("make", "kinds"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1), ADAM_KINDS),
        (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1), foreach=False), ADAM_KINDS),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            {"momentum_buffer"},
        ),
    ],
    ids=["adamw", "adamw-tensor-lr", "sgd-momentum"],
)
def test_only_the_chosen_parameters_get_state_and_nothing_else_changes(make, kinds):
    model = _model()
    optimizer = make(model.parameters())
    trained, frozen = model[0], model[1]
    trained.weight.grad = torch.full_like(trained.weight, 0.5)  # a pending gradient
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = optimizer.param_groups[0]["lr"]

    st.create_optimizer_state(optimizer, [frozen.weight, frozen.bias])

    assert set(optimizer.state) == {frozen.weight, frozen.bias}
    assert set(optimizer.state[frozen.weight]) == kinds
    for name, param in model.named_parameters():
        assert torch.equal(param, values[name]), name
    assert optimizer.param_groups[0]["lr"] is lr
    assert torch.equal(trained.weight.grad, torch.full_like(trained.weight, 0.5))
    assert trained.bias.grad is None and frozen.weight.grad is None
    assert not frozen.weight.requires_grad


def test_state_dict_names_each_parameter_once_under_its_fqn():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrapped = torch.nn.Module()
    wrapped.inner = model
    found = st.parameters_by_fqn(wrapped)
    assert found == {"inner.0.weight": model[0].weight, "inner.0.bias": model[0].bias}
