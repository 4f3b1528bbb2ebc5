"""State-dict hooks that gather rows of a parameter, as torchtitan 0.3.0's ``FusedQKVLinear``
does with grouped-query attention: ``wq`` is the first ``hpk`` head rows of each kv group of
``wqkv``, ``wk``/``wv`` the next, copied out with reshape/index/contiguous."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardstream
from shardstream.errors import CheckpointFormatError
from shardstream.training import hooks


class FusedQKV(torch.nn.Module):
    def __init__(self, dim=8, n_heads=4, n_kv=2, head_dim=2):
        super().__init__()
        self.hd, self.hpk = head_dim, n_heads // n_kv
        rows = n_kv * (self.hpk + 2) * head_dim
        self.wqkv = torch.nn.Linear(dim, rows, bias=True)
        self.register_state_dict_post_hook(self._split)

    @staticmethod
    def _split(module, state, prefix, metadata):
        hd, hpk, r = module.hd, module.hpk, module.hpk + 2
        for param, ndim in (("weight", 4), ("bias", 3)):
            tensor = state.pop(f"{prefix}wqkv.{param}")
            n_kv = tensor.shape[0] // (r * hd)
            tail = (tensor.shape[1],) if ndim == 4 else ()
            w = tensor.reshape(n_kv, r, hd, *tail)
            state[f"{prefix}wq.{param}"] = w[:, :hpk].reshape(-1, *tail).contiguous()
            state[f"{prefix}wk.{param}"] = w[:, hpk].reshape(-1, *tail).contiguous()
            state[f"{prefix}wv.{param}"] = w[:, hpk + 1].reshape(-1, *tail).contiguous()


class Model(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = FusedQKV()
        self.out = torch.nn.Linear(8, 3)


def test_gathered_rows_map_back_to_the_parameter():
    model = Model(0)
    regions = hooks.presented_regions(model)
    live = dict(model.named_parameters())
    for key, want in model.state_dict().items():
        region = regions[key]
        tensor = live[region.live].detach()
        runs = region.rows or ((0, region.shape[0], region.start),)
        parts = [
            tensor[tuple(slice(s, s + n) for s, n in zip(start, (count, *region.shape[1:])))]
            for _, count, start in runs
        ]
        assert torch.equal(torch.cat(parts), want), key
    assert len(regions["attn.wq.weight"].rows) == 2  # one run per kv group


def test_gathered_hook_model_restores_bit_for_bit(tmp_path):
    saved = Model(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved.state_dict(), checkpoint_id=str(tmp_path / "step-1"))
        fresh = Model(1)
        shardstream.load(tmp_path / "step-1", model=fresh)
    for (name, want), got in zip(saved.named_parameters(), fresh.parameters()):
        assert torch.equal(got, want), name


def test_a_hook_doing_arithmetic_is_refused():
    model = Model(0)

    def scaled(module, state, prefix, metadata):
        state[f"{prefix}wqkv.weight"] = state[f"{prefix}wqkv.weight"] * 2

    model.attn._state_dict_hooks.clear()
    model.attn.register_state_dict_post_hook(scaled)
    with pytest.raises(CheckpointFormatError, match="new tensor"):
        hooks.presented_regions(model)
