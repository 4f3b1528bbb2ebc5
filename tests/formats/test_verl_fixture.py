"""The verl checkpoint generator writes what verl 0.9 writes.

All checkpoints come from one ``write_verl_checkpoints`` call per session (one launcher,
forked gloo ranks); the tests only read files, always with ``weights_only=True``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (registers DTensor/DeviceMesh for torch.load)
from torch.distributed.tensor import DTensor, Replicate, Shard

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from shardstream.testing import tiny_models as tm  # noqa: E402
from shardstream.testing.verl_checkpoint import (  # noqa: E402
    VerlFixture,
    main,
    write_verl_checkpoints,
)

pytestmark = pytest.mark.slow

FIXTURES = {
    # name: (fixture, step)
    "uneven4": (VerlFixture(world_size=4), 1),
    "hsdp_tie": (
        VerlFixture(world_size=4, mesh_shape=(2, 2), arch="llama", tie_word_embeddings=True),
        1,
    ),
    "lora_s1": (
        VerlFixture(world_size=4, lora=True, shard_dim=1, lora_layout="both", train_steps=2),
        1,
    ),
    "plain4": (VerlFixture(world_size=4, arch="plain", train_steps=2), 1),
    "lora2": (VerlFixture(world_size=2, lora=True), 2),
    "old1": (
        VerlFixture(
            world_size=1,
            hf_in_subdir=False,
            write_fsdp_config=False,
            write_optimizer=False,
            train_steps=0,
        ),
        3,
    ),
}


@pytest.fixture(scope="session")
def verl_roots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("verl_fixtures")
    jobs = [(base / name, fx, step) for name, (fx, step) in FIXTURES.items()]
    write_verl_checkpoints(jobs, timeout=600)
    return {name: base / name for name in FIXTURES}


def _actor(roots, name) -> Path:
    return roots[name] / f"global_step_{FIXTURES[name][1]}" / "actor"


def _load(path: Path, device: str = "meta"):
    return torch.load(path, weights_only=True, map_location=device)


def _shards(roots, name, device: str = "meta") -> list[dict]:
    ws = FIXTURES[name][0].world_size
    actor = _actor(roots, name)
    return [_load(actor / f"model_world_size_{ws}_rank_{r}.pt", device) for r in range(ws)]


def _rows(shards, key) -> list[tuple[int, ...]]:
    return [tuple(sd[key].to_local().shape) for sd in shards]


def _unshard(shards: list[dict]) -> dict[str, torch.Tensor]:
    """Reference unsharding: concatenate the local shards of one replica along the shard dim."""
    out = {}
    for key, v in shards[0].items():
        if not isinstance(v, DTensor):
            out[key] = v
            continue
        n = v.device_mesh.mesh.shape[-1]
        out[key] = torch.cat([sd[key].to_local() for sd in shards[:n]], dim=v.placements[-1].dim)
    return out


# --------------------------------------------------------------------------- layout


def test_file_names_match_verl(verl_roots):
    actor = _actor(verl_roots, "uneven4")
    names = {p.name for p in actor.iterdir()}
    expected = {"fsdp_config.json", "huggingface"}
    for r in range(4):
        for kind in ("model", "optim", "extra_state"):
            expected.add(f"{kind}_world_size_4_rank_{r}.pt")
    assert names == expected
    hf = {p.name for p in (actor / "huggingface").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= hf
    assert "tokenizer_config.json" in hf
    step_dir = actor.parent
    assert (step_dir / "data.pt").is_file()
    assert (verl_roots["uneven4"] / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert _load(step_dir / "data.pt", "cpu")  # plain data, weights_only-safe


def test_fsdp_config_json(verl_roots):
    for name, ws in (("uneven4", 4), ("lora2", 2)):
        text = (_actor(verl_roots, name) / "fsdp_config.json").read_text()
        assert json.loads(text) == {"FSDP_version": 2, "world_size": ws}
        assert text.startswith('{\n    "FSDP_version"')  # json.dump(..., indent=4)


def test_old_layout_world_size_one(verl_roots):
    actor = _actor(verl_roots, "old1")
    names = {p.name for p in actor.iterdir()}
    assert "fsdp_config.json" not in names and "huggingface" not in names
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert names >= {"model_world_size_1_rank_0.pt", "extra_state_world_size_1_rank_0.pt"}
    assert not any(n.startswith("optim_") for n in names)
    assert (verl_roots["old1"] / "latest_checkpointed_iteration.txt").read_text() == "3"
    # FSDP2 on a 1-rank mesh still saves DTensors, Shard(0), holding the full tensor
    sd = _shards(verl_roots, "old1")[0]
    for v in sd.values():
        assert isinstance(v, DTensor)
        assert v.placements == (Shard(0),)
        assert v.to_local().shape == v.shape
    # train_steps=0: the checkpoint is the seeded random init
    model = tm.build_tiny_model(tm.tiny_config("qwen2"), seed=0)
    ref = load_file(verl_roots["old1"] / "reference" / "model.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(ref[k], v), k


def test_config_json_names_bfloat16_both_keys(verl_roots):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    hf = _actor(verl_roots, "uneven4") / "huggingface"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["torch_dtype"] == "bfloat16"
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (48, 86, 101)
    assert AutoConfig.from_pretrained(hf).dtype == torch.bfloat16
    gen = GenerationConfig.from_pretrained(hf)
    assert (gen.do_sample, gen.temperature, gen.top_p) == (True, 0.7, 0.8)
    tok = AutoTokenizer.from_pretrained(hf)
    assert len(tok) == 101 and tok.eos_token_id == tm.EOS_ID and tok.pad_token_id == tm.PAD_ID
    ids = tok("the test")["input_ids"]
    assert tok.decode(ids) == "the test" and max(ids) < 101
    llama = _actor(verl_roots, "hsdp_tie") / "huggingface"
    assert json.loads((llama / "config.json").read_text())["tie_word_embeddings"] is True


def test_extra_state_contents(verl_roots):
    import numpy as np

    actor = _actor(verl_roots, "uneven4")
    path = actor / "extra_state_world_size_4_rank_2.pt"
    # exactly as with real verl: numpy's RNG state needs numpy globals allow-listed
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    assert unsafe and all(u.startswith("numpy.") for u in unsafe)
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    with torch.serialization.safe_globals(allowed):
        extra = _load(path, "cpu")
    assert set(extra) == {"lr_scheduler", "rng"}
    assert set(extra["rng"]) == {"cpu", "numpy", "random"}
    assert extra["rng"]["cpu"].dtype == torch.uint8
    sched = extra["lr_scheduler"]
    assert sched["last_epoch"] == 1 and sched["lr_lambdas"] == [None]  # LambdaLR, 1 step


def test_optimizer_state_is_sharded_adamw(verl_roots):
    fx, _ = FIXTURES["uneven4"]
    actor = _actor(verl_roots, "uneven4")
    shards = _shards(verl_roots, "uneven4")
    keys = list(shards[0])
    for r in range(4):
        osd = _load(actor / f"optim_world_size_4_rank_{r}.pt")
        (group,) = osd["param_groups"]
        assert group["lr"] == pytest.approx(fx.lr) and group["weight_decay"] == 0.01
        assert group["params"] == list(range(len(keys)))
        state = osd["state"][keys.index("lm_head.weight")]
        assert state["step"].shape == () and not isinstance(state["step"], DTensor)
        assert isinstance(state["exp_avg"], DTensor)
        assert state["exp_avg"].placements == (Shard(0),)
        assert state["exp_avg"].to_local().shape == shards[r]["lm_head.weight"].to_local().shape


# --------------------------------------------------------------------------- placements


def test_uneven_shard0_placements(verl_roots):
    shards = _shards(verl_roots, "uneven4")
    for sd in shards:
        for v in sd.values():
            assert isinstance(v, DTensor)
            assert v.placements == (Shard(0),)
            assert v.device_mesh.mesh_dim_names == ("fsdp",)
    assert _rows(shards, "model.embed_tokens.weight") == [(26, 48)] * 3 + [(23, 48)]
    assert _rows(shards, "model.layers.0.mlp.gate_proj.weight") == [(22, 48)] * 3 + [(20, 48)]
    assert _rows(shards, "model.layers.1.mlp.down_proj.weight") == [(12, 86)] * 4
    # untied: both matrices saved
    assert "lm_head.weight" in shards[0] and "model.embed_tokens.weight" in shards[0]


def test_hsdp_placements_and_tied_embeddings(verl_roots):
    shards = _shards(verl_roots, "hsdp_tie", "cpu")
    for sd in shards:
        for v in sd.values():
            assert v.placements == (Replicate(), Shard(0))
            assert v.device_mesh.mesh_dim_names == ("ddp", "fsdp")
            assert tuple(v.device_mesh.mesh.shape) == (2, 2)
    # rank r holds fsdp shard r % 2; replicas agree bit for bit
    for key in shards[0]:
        for r in (2, 3):
            assert torch.equal(shards[r][key].to_local(), shards[r - 2][key].to_local()), key
    assert _rows(shards, "model.embed_tokens.weight") == [(51, 48), (50, 48)] * 2
    # tied: both keys saved; two DTensor objects over one storage (saved once)
    sd = shards[0]
    head, embed = sd["lm_head.weight"].to_local(), sd["model.embed_tokens.weight"].to_local()
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    ref = load_file(verl_roots["hsdp_tie"] / "reference" / "model.safetensors")
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])


def test_shard_dim_1(verl_roots):
    shards = _shards(verl_roots, "lora_s1")
    sd = shards[0]
    p = "base_model.model.model.layers.0."
    # 2-D params whose dim 1 divides 4 get Shard(1); others keep FSDP2's default Shard(0)
    assert sd[p + "self_attn.q_proj.base_layer.weight"].placements == (Shard(1),)
    assert _rows(shards, p + "self_attn.q_proj.base_layer.weight") == [(48, 12)] * 4
    assert sd["base_model.model.lm_head.weight"].placements == (Shard(1),)
    assert sd[p + "mlp.down_proj.base_layer.weight"].placements == (Shard(0),)  # 86 % 4 != 0
    assert sd[p + "self_attn.q_proj.base_layer.bias"].placements == (Shard(0),)
    assert sd[p + "input_layernorm.weight"].placements == (Shard(0),)
    assert sd[p + "self_attn.q_proj.lora_A.default.weight"].placements == (Shard(1),)
    assert sd[p + "self_attn.q_proj.lora_B.default.weight"].placements == (Shard(0),)


def test_zero_row_shards(verl_roots):
    # LoRA r=3 at world size 4: lora_A rows split 1/1/1/0
    s1 = _shards(verl_roots, "lora_s1")
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"
    assert _rows(s1, key) == [(1, 86)] * 3 + [(0, 86)]
    # PlainModule at world size 4
    plain = _shards(verl_roots, "plain4")
    assert _rows(plain, "proj.weight") == [(2, 6), (2, 6), (1, 6), (0, 6)]
    assert _rows(plain, "head.weight") == [(1, 5)] * 3 + [(0, 5)]
    assert _rows(plain, "gain") == [(1,), (0,), (0,), (0,)]
    # LoRA r=3 at world size 2: uneven 2/1
    s2 = _shards(verl_roots, "lora2")
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.default.weight"
    assert _rows(s2, key) == [(2, 48), (1, 48)]


def test_plain_module_buffers_and_scalars(verl_roots):
    shards = _shards(verl_roots, "plain4", "cpu")
    sd = shards[0]
    assert "scratch" not in sd  # non-persistent buffer
    for key in ("temperature", "step_count", "running_mean"):
        assert not isinstance(sd[key], DTensor), key
        for other in shards[1:]:
            assert torch.equal(other[key], sd[key]), key  # replicated on every rank
    assert sd["temperature"].shape == () and sd["temperature"].dtype == torch.float32
    assert sd["step_count"].shape == () and sd["step_count"].dtype == torch.int64
    assert int(sd["step_count"]) == 3
    assert float(sd["temperature"]) != 0.5  # trained (gradients all-reduced by hand)
    assert isinstance(sd["gain"], DTensor) and sd["gain"].shape == (1,)
    ref = load_file(verl_roots["plain4"] / "reference" / "model.safetensors")
    assert ref["step_count"].dtype == torch.int64 and ref["temperature"].shape == ()
    assert "huggingface" not in {p.name for p in _actor(verl_roots, "plain4").iterdir()}


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("name", ["uneven4", "hsdp_tie", "plain4", "old1"])
def test_reference_equals_unsharded_checkpoint(verl_roots, name):
    full = _unshard(_shards(verl_roots, name, "cpu"))
    ref = load_file(verl_roots[name] / "reference" / "model.safetensors")
    assert set(full) == set(ref)
    for k, v in full.items():
        assert torch.equal(v, ref[k]), k


def test_reference_logits_reproduce(verl_roots):
    root = verl_roots["uneven4"]
    config = tm.tiny_config("qwen2")
    model = tm.build_tiny_model(config, seed=None)
    model.load_state_dict(load_file(root / "reference" / "model.safetensors"))
    model.eval()
    ref = load_file(root / "reference" / "logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits
    assert ref["logits"].dtype == torch.float32 and ref["logits"].shape == (2, 9, 101)
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=0)
    # training moved every parameter away from the seeded init
    init = tm.build_tiny_model(config, seed=0).state_dict()
    trained = model.state_dict()
    assert all(not torch.equal(init[k], trained[k]) for k in init)


# --------------------------------------------------------------------------- LoRA


def test_lora_keys_and_metadata(verl_roots):
    fx, _ = FIXTURES["lora2"]
    actor = _actor(verl_roots, "lora2")
    sd = _shards(verl_roots, "lora2")[0]
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    assert {p + "base_layer.weight", p + "base_layer.bias"} <= set(sd)
    assert {p + "lora_A.default.weight", p + "lora_B.default.weight"} <= set(sd)
    assert sd[p + "lora_A.default.weight"].shape == (fx.lora_rank, 48)
    assert sd[p + "lora_B.default.weight"].shape == (48, fx.lora_rank)
    assert "base_model.model.lm_head.weight" in sd  # lm_head is not a LoRA target
    assert not any("lm_head.lora" in k or "embed_tokens.lora" in k for k in sd)
    lora_keys = [k for k in sd if "lora_" in k]
    assert len(lora_keys) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    meta = json.loads((actor / "lora_train_meta.json").read_text())
    assert meta == {"r": 3, "lora_alpha": 6, "task_type": "CAUSAL_LM"}
    assert not (actor / "lora_adapter").exists()  # verl >= 0.8 writes only the metadata


def test_lora_adapter_dir_and_fused_reference(verl_roots):
    root = verl_roots["lora_s1"]
    actor = _actor(verl_roots, "lora_s1")
    full = _unshard(_shards(verl_roots, "lora_s1", "cpu"))
    ref_base = load_file(root / "reference" / "model.safetensors")
    ref_fused = load_file(root / "reference" / "fused.safetensors")
    ref_adapter = load_file(root / "reference" / "adapter_model.safetensors")
    # base reference under plain HF names
    base = tm.base_state_dict(full)
    assert set(base) == set(ref_base)
    assert "model.layers.0.self_attn.q_proj.weight" in ref_base
    assert all(torch.equal(base[k], ref_base[k]) for k in base)
    # fused = W + (alpha / r) * B @ A, and LoRA B is no longer zero after training
    key = "base_model.model.model.layers.1.mlp.up_proj."
    a, b = full[key + "lora_A.default.weight"], full[key + "lora_B.default.weight"]
    assert b.abs().max() > 0
    w = full[key + "base_layer.weight"]
    torch.testing.assert_close(ref_fused["model.layers.1.mlp.up_proj.weight"], w + 2.0 * b @ a)
    assert torch.equal(ref_fused["model.norm.weight"], ref_base["model.norm.weight"])
    # adapter files: PEFT's saved naming (no ".default"), old-verl lora_adapter/ identical
    old = load_file(actor / "lora_adapter" / "adapter_model.safetensors")
    assert set(old) == set(ref_adapter)
    assert key + "lora_A.weight" in old
    assert all(torch.equal(old[k], ref_adapter[k]) for k in old)
    cfg = json.loads((actor / "lora_adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"], cfg["task_type"]) == (
        3,
        6,
        "LORA",
        "CAUSAL_LM",
    )
    assert sorted(cfg["target_modules"]) == sorted(tm.LORA_TARGETS)
    logits = load_file(root / "reference" / "logits.safetensors")
    assert set(logits) == {"input_ids", "logits", "base_logits"}
    assert not torch.equal(logits["logits"], logits["base_logits"])


# --------------------------------------------------------------------------- API / CLI


def test_fixture_validation():
    with pytest.raises(ValueError):
        VerlFixture(world_size=4, mesh_shape=(3, 2))
    with pytest.raises(ValueError):
        VerlFixture(arch="plain", lora=True)
    with pytest.raises(ValueError):
        VerlFixture(shard_dim=2)
    fx = VerlFixture(world_size=4, mesh_shape=(2, 2))
    assert fx.mesh_dim_names == ("ddp", "fsdp") and fx.fsdp_size == 2
    assert VerlFixture.from_json(json.loads(json.dumps(fx.to_json()))) == fx


def test_cli_plain_world_size_one(tmp_path, capsys):
    assert main([str(tmp_path), "--world-size", "1", "--arch", "plain", "--no-reference"]) == 0
    actor = tmp_path / "global_step_1" / "actor"
    assert str(actor) in capsys.readouterr().out
    sd = _load(actor / "model_world_size_1_rank_0.pt")
    assert sd["proj.weight"].placements == (Shard(0),)
    assert not (tmp_path / "reference").exists()
