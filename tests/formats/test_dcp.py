"""PyTorch DCP checkpoints as a merge source: real FSDP2 saves over gloo, hostile metadata.

The FSDP2 checkpoints are written by ``python tests/formats/test_dcp.py worker ...`` processes
(one per rank, joined over gloo with a file store), like tests/conftest.py does for verl, so
nothing depends on pickling test functions into children. The run writes:

``model_only``    ``dcp.save(model.state_dict())`` before training: HF keys at the top level
``train_state``   ``{"model": ..., "optim": ...}`` after one AdamW step (FQN-keyed optimizer)
``titan``         torchtitan's layout: model keys at the top level next to ``optimizer``
                  (flattened), ``lr_scheduler``, ``dataloader`` and ``train_state``
``accelerate``    ``checkpoint-1/pytorch_model_fsdp_0`` holding ``{"model": ...}``, with
                  config.json in ``checkpoint-1`` as the HF Trainer leaves it

plus ``reference/initial.safetensors`` and ``reference/trained.safetensors`` (full tensors),
for a tiny Qwen2 (untied) and a tiny Llama (tied embeddings), all at world size 3; and
``plain``: a module whose parameters have fewer rows than ranks (empty shards).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from shardstream import cli
from shardstream.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from shardstream.formats import dcp_pickles
from shardstream.formats.source import is_dcp_checkpoint, open_checkpoint
from shardstream.testing.cli import run_cli
from shardstream.testing.compare import assert_bit_identical

TINY = {
    "hidden_size": 48,
    "intermediate_size": 86,
    "vocab_size": 101,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
WORLD_SIZE = 3  # 101 vocab rows -> 34/34/33, 86 intermediate rows -> 29/29/28
# model directory -> (arch, tied embeddings)
MODELS = {"qwen2": ("qwen2", False), "llama": ("llama", True)}
LAYOUTS = ("model_only", "train_state", "titan", "accelerate")
ACCELERATE_DIR = Path("checkpoint-1") / "pytorch_model_fsdp_0"
INPUT_IDS = [[5, 17, 99, 42, 7, 63, 100, 1]]


def _config(arch: str, tied: bool):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = cls(**TINY, tie_word_embeddings=tied)
    config.architectures = [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]]
    return config


def _layout_dir(root: Path, layout: str) -> Path:
    return root / (ACCELERATE_DIR if layout == "accelerate" else Path(layout))


# --------------------------------------------------------------------------- the FSDP2 writer


def _worker(rank: int, world_size: int, init_file: str, base: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for name in MODELS:
        _save_layouts(Path(base) / name, rank, mesh)
    _save_small_params(Path(base) / "plain", rank, mesh)
    dist.destroy_process_group()


def _save_small_params(root: Path, rank: int, mesh) -> None:
    """Parameters with fewer rows than ranks: some ranks hold empty shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Module()
    model.proj = nn.Linear(6, 2)  # 2 rows over 3 ranks: 1/1/0
    model.gain = nn.Parameter(torch.rand(1))  # 1/0/0
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=mesh)
    dcp.save(model.state_dict(), checkpoint_id=root)
    if rank == 0:
        save_file(full, str(root / "reference.safetensors"))
    dist.barrier()


def _save_layouts(root: Path, rank: int, mesh) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(root / "hf")
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(load_file(root / "reference" / "initial.safetensors"), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    dcp.save(model.state_dict(), checkpoint_id=root / "model_only")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(INPUT_IDS)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "train_state")
    flat_optim = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    titan = {
        **model_sd,
        "optimizer": flat_optim,
        "lr_scheduler": {"last_epoch": 1, "base_lrs": [1e-2]},
        "dataloader": {f"dp_rank_{rank}": io.BytesIO(b"sampler state")},
        "train_state": {"step": torch.tensor(1, dtype=torch.int32), "losses": io.BytesIO(b"[]")},
    }
    dcp.save(titan, checkpoint_id=root / "titan")
    dcp.save({"model": model_sd}, checkpoint_id=root / ACCELERATE_DIR)

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        full = {k: v.contiguous() for k, v in full.items()}
        if config.tie_word_embeddings:
            full.pop("lm_head.weight", None)
        save_file(full, str(root / "reference" / "trained.safetensors"))
    dist.barrier()


def _prepare(root: Path, arch: str, tied: bool) -> None:
    """config.json (also where accelerate's Trainer leaves it) and the initial weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = _config(arch, tied)
    config.save_pretrained(root / "hf")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    (root / "reference").mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    save_file(state, str(root / "reference" / "initial.safetensors"))
    (root / ACCELERATE_DIR.parent).mkdir(parents=True)
    config.save_pretrained(root / ACCELERATE_DIR.parent)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict[str, Path]:
    """Every model's checkpoints from one 3-rank run (read-only: copy before changing)."""
    base = tmp_path_factory.mktemp("dcp")
    for name, (arch, tied) in MODELS.items():
        _prepare(base / name, arch, tied)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    init = base / "gloo-init"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(r), str(WORLD_SIZE), str(init), str(base)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD_SIZE)
    ]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("DCP worker failed:\n" + "\n".join(outputs))
    return {name: base / name for name in (*MODELS, "plain")}


# --------------------------------------------------------------------------- helpers


def _load_merged(target: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = target / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        merged.update(load_file(target / name))
    return merged


def _expected(root: Path, layout: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    which = "initial" if layout == "model_only" else "trained"
    ref = load_file(root / "reference" / f"{which}.safetensors")
    return {
        k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in ref.items()
    }


def _merge(source: Path, target: Path, *extra: str) -> None:
    rc = cli.main(
        ["merge", "--local_dir", str(source), "--target_dir", str(target), "--quiet", *extra]
    )
    assert rc == 0


# --------------------------------------------------------------------------- FSDP2 checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_fsdp2_qwen2_layouts_bit_identical(fsdp_runs, tmp_path, layout):
    root = fsdp_runs["qwen2"]
    source = _layout_dir(root, layout)
    extra = [] if layout == "accelerate" else ["--hf_model_path", str(root / "hf")]
    _merge(source, tmp_path / "out", *extra)
    merged = _load_merged(tmp_path / "out")
    assert_bit_identical(merged, _expected(root, layout, torch.float32))
    # config.json comes from --hf_model_path, or accelerate's enclosing Trainer checkpoint.
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 101


@pytest.mark.slow
def test_merged_model_loads_with_transformers_and_matches_logits(fsdp_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root = fsdp_runs["qwen2"]
    _merge(root / "train_state", tmp_path / "out", "--hf_model_path", str(root / "hf"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_config(_config("qwen2", False))
    reference.load_state_dict(_expected(root, "train_state", torch.float32))
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        got, want = merged(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_merge_tied_llama_titan_layout_to_bf16(fsdp_runs, tmp_path):
    """torchtitan layout, tied embeddings (lm_head dropped), cast to bf16 bit-exactly."""
    from transformers import AutoModelForCausalLM

    root = fsdp_runs["llama"]
    _merge(root / "titan", tmp_path / "out", "--hf_model_path", str(root / "hf"), "--dtype", "bf16")
    merged = _load_merged(tmp_path / "out")
    expected = _expected(root, "titan", torch.bfloat16)
    assert_bit_identical(merged, expected)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_config(_config("llama", True), dtype=torch.bfloat16)
    reference.load_state_dict(expected, strict=False)
    reference.tie_weights()
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_reader_describes_fsdp2_chunks_and_skips_training_state(fsdp_runs):
    root = fsdp_runs["llama"]
    ckpt = open_checkpoint(root / "titan")
    assert ckpt.format == "dcp"
    assert ckpt.world_size == 3
    assert ckpt.layout == "model at top level with training state"
    embed = next(t for t in ckpt.tensors if t.name == "model.embed_tokens.weight")
    assert embed.shape == (101, 48)
    assert [b.shape[0] for b in embed.blocks] == [34, 34, 33]
    assert ckpt.placements[embed.name] == "3 chunks along dim 0"
    assert all(b.location.endswith(".distcp") for b in embed.blocks)
    assert not any(
        n.startswith(("optimizer", "train_state", "lr_scheduler")) for n in ckpt.placements
    )
    assert ckpt.skipped["train_state.step"] == "training state (train_state)"
    assert ckpt.skipped["train_state.losses"] == "not a tensor (pickled bytes)"
    assert any(k.startswith("optimizer.state.") for k in ckpt.skipped)
    # The nested train state: 'model.' stripped, 'optim.*' skipped.
    nested = open_checkpoint(fsdp_runs["qwen2"] / "train_state")
    assert nested.layout == "train state (model under 'model')"
    assert "lm_head.weight" in nested.placements
    assert all(k.startswith("optim.") for k in nested.skipped)


@pytest.mark.slow
def test_empty_shards_of_small_parameters(fsdp_runs, tmp_path):
    from safetensors.torch import load_file

    root = fsdp_runs["plain"]
    ckpt = open_checkpoint(root)
    gain = next(t for t in ckpt.tensors if t.name == "gain")
    assert sorted(b.shape for b in gain.blocks) == [(0,), (1,)]  # DCP dedups the empty ones
    proj = next(t for t in ckpt.tensors if t.name == "proj.weight")
    assert [b.shape for b in proj.blocks] == [(1, 6), (1, 6), (0, 6)]
    _merge(root, tmp_path / "out")
    assert_bit_identical(_load_merged(tmp_path / "out"), load_file(root / "reference.safetensors"))


@pytest.mark.slow
def test_merge_without_config_writes_weights_only_and_says_so(fsdp_runs, tmp_path):
    from shardstream import merge

    root = fsdp_runs["qwen2"]
    assert open_checkpoint(root / "model_only").config_dir() is None
    summary = merge(root / "model_only", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert_bit_identical(_load_merged(tmp_path / "out"), _expected(root, "model_only", None))
    assert any("wrote the weights only" in note for note in summary.notes), summary.notes


def test_inspect_plans_with_the_config_merge_would_be_given(fsdp_runs, tmp_path, capsys):
    """inspect said "pass --hf_model_path" for a checkpoint without a config, and took no such
    option: what merge will write (its layout, its dtype) could not be seen before it ran."""
    root = fsdp_runs["qwen2"]
    assert cli.main(["inspect", str(root / "model_only"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config_dir"] is None
    argv = ["inspect", str(root / "model_only"), "--json", "--hf_model_path", str(root / "hf")]
    assert cli.main(argv) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config_dir"] == str(root / "hf") and "qwen2" in json.dumps(info["merge"])
    assert cli.main([*argv[:-1], str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err


@pytest.mark.slow
def test_inspect_and_test_commands_accept_dcp(fsdp_runs, tmp_path, capsys):
    pytest.importorskip("shardstream.commands.inspect")
    pytest.importorskip("shardstream.commands.test")
    from safetensors.torch import save_file

    root = fsdp_runs["qwen2"]
    assert cli.main(["inspect", str(root / "train_state"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "dcp"
    ref = tmp_path / "ref"
    shutil.copytree(root / "hf", ref)
    save_file(_expected(root, "train_state", None), str(ref / "model.safetensors"))
    rc = cli.main(
        ["test", "--local_dir", str(root / "train_state"), "--test_hf_dir", str(ref), "--quiet"]
    )
    assert rc == 0


# --------------------------------------------------------------------------- single process


def _save_plain(directory: Path, state: dict, **writer_kwargs) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(directory, **writer_kwargs) if writer_kwargs else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=directory, storage_writer=writer)


def _plain_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "transposed": torch.randn(4, 6, generator=g).t(),  # saved with strides (1, 6)
        "empty": torch.zeros(0, 3),
    }


def test_single_process_plain_tensors(tmp_path):
    state = _plain_state()
    _save_plain(tmp_path / "ck", state, thread_count=2)  # two files: __0_0 and __0_1
    ckpt = open_checkpoint(tmp_path / "ck")
    assert ckpt.layout == "model at top level"
    assert len(ckpt.files) == 2
    transposed = next(t for t in ckpt.tensors if t.name == "transposed")
    assert transposed.blocks[0].strides == (1, 6)
    _merge(tmp_path / "ck", tmp_path / "out")
    assert_bit_identical(_load_merged(tmp_path / "out"), state)


def test_a_lazily_conjugated_tensor_dcp_saved_is_refused_not_merged_unconjugated(tmp_path, capsys):
    """``dcp.save`` of ``x.conj()`` stores x's bytes and a conj bit in the chunk's pickle,
    which torch's load applies: merge wrote x (exit 0) and verify passed it."""
    state = {"w": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(), "b": torch.ones(2)}
    _save_plain(tmp_path / "ck", state)
    for argv in (
        ["merge", "--local_dir", str(tmp_path / "ck"), "--target_dir", str(tmp_path / "out")],
        ["verify", str(tmp_path / "ck")],
    ):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "chunk of 'w'" in err and "a tensor saved as a lazily conj view" in err, err
        assert "malformed" not in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("pickled", "value"),
    [
        (b"\x80\x04K\x07\x94K\x08\x94h\x00.", 7),  # MEMOIZE twice, BINGET 0
        (b"I7\np5\n0g5\n.", 7),  # PUT 5 with no entry before it, POP, GET 5
        (b"\x80\x04K\x07r\x05\x00\x00\x000K\x08\x94h\x01.", 8),  # MEMOIZE after a gap
        (b"I7\np5\n0g4\n.", None),  # GET of an entry never stored
    ],
    ids=["in-order", "gap", "memoize-after-gap", "never-stored"],
)
def test_the_opcode_pass_keeps_the_memo_as_the_unpickler_does(pickled, value):
    """The pass keeps its memo as a list while entries come in order (a DCP .metadata memoizes
    millions): out-of-order entries, and MEMOIZE's next index (the count of entries), must
    still be the unpickler's."""
    if value is None:
        with pytest.raises(pickle.UnpicklingError):
            pickle.loads(pickled)
        with pytest.raises(CheckpointFormatError, match="memo entry 4, never stored"):
            dcp_pickles.check_pickle(pickled)
        return
    assert pickle.loads(pickled) == value
    dcp_pickles.check_pickle(pickled)


def test_a_hostile_pickle_leaves_the_opcode_pass_as_it_was_for_the_next(tmp_path):
    """The pass shares one node among a pickle's scalars: one that appends 100 items to an
    int made every scalar of every later pickle in the process dearer, and torch.save's own
    storages ("a persistent id of 101 or more items") were refused from then on."""
    import zipfile

    hostile = b"\x80\x02K\x01(" + b"K\x02" * 100 + b"e."
    with contextlib.suppress(CheckpointFormatError):
        dcp_pickles.check_pickle(hostile)
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    with zipfile.ZipFile(tmp_path / "w.pt") as archive:
        pickled = next(archive.read(n) for n in archive.namelist() if n.endswith("/data.pkl"))
    dcp_pickles.check_pickle(pickled)


def test_a_checkpoint_of_an_empty_state_dict_is_said_to_be_empty(tmp_path):
    """merge blamed DCP's planner ("its 0 entries (e.g. ) are pickled objects") and verify
    passed it."""
    from shardstream.commands.verify import verify

    _save_plain(tmp_path / "ck", {})
    with pytest.raises(CheckpointNotFoundError, match="holds no entries: an empty state dict"):
        open_checkpoint(tmp_path / "ck", model_only=True)
    problems = [p.line() for p in verify(tmp_path / "ck").problems]
    assert any("holds no entries" in line for line in problems), problems


@pytest.mark.parametrize(
    ("left_out", "tied"),
    [("model.embed_tokens.weight", False), ("lm_head.weight", False), ("lm_head.weight", True)],
    ids=["frozen embedding", "untied head", "tied head (none stored: fine)"],
)
def test_a_decoder_saved_without_its_embedding_or_head_is_refused(tmp_path, capsys, left_out, tied):
    """``get_state_dict(..., StateDictOptions(ignore_frozen_params=True))`` leaves a frozen
    embedding out: merge wrote a model without it (exit 0, no note), which transformers then
    started at random."""
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2", tie_word_embeddings=tied)
    state = {k: v for k, v in build_tiny_model(config).state_dict().items() if k != left_out}
    _save_plain(tmp_path / "ck", state)
    config.save_pretrained(tmp_path / "hf")
    argv = ["--hf_model_path", str(tmp_path / "hf")]
    rc = cli.main(
        ["merge", "--local_dir", str(tmp_path / "ck"), "--target_dir", str(tmp_path / "o"), *argv]
    )
    err = capsys.readouterr().err
    if tied:
        assert rc == 0, err
        return
    assert rc == 1 and not (tmp_path / "o").exists(), err
    assert f"the checkpoint holds no {left_out}" in err and "ignore_frozen_params" in err, err


def test_a_critic_whose_config_names_the_actors_causal_lm_class_merges(tmp_path, capsys):
    """verl builds its critic (a token-classification model, head ``score``) from the actor's
    config and saves that config.json as it is, ``*ForCausalLM`` and untied: merge refused it
    for lacking ``lm_head.weight``, where verl's merger merges it."""
    from transformers import Qwen2ForTokenClassification

    from shardstream.testing.tiny_models import tiny_config

    config = tiny_config("qwen2", tie_word_embeddings=False)
    config.num_labels = 1
    state = dict(Qwen2ForTokenClassification(config).state_dict())
    assert "score.weight" in state and "lm_head.weight" not in state
    _save_plain(tmp_path / "ck", state)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path / "hf")
    argv = ["--local_dir", str(tmp_path / "ck"), "--hf_model_path", str(tmp_path / "hf")]
    rc = cli.main(["merge", *argv, "--target_dir", str(tmp_path / "o"), "--is-value-model"])
    assert rc == 0, capsys.readouterr().err
    assert_bit_identical(_load_merged(tmp_path / "o"), state)


def _internlm2_like(vocab: int = 96, hidden: int = 16) -> tuple[dict, dict]:
    """A remote-code decoder's names (InternLM2's: ``model.tok_embeddings``, ``output``) and its
    config.json, which transformers itself does not know."""
    g = torch.Generator().manual_seed(2)
    state = {
        "model.tok_embeddings.weight": torch.randn(vocab, hidden, generator=g),
        "model.layers.0.attention.wqkv.weight": torch.randn(3 * hidden, hidden, generator=g),
        "model.layers.0.attention_norm.weight": torch.ones(hidden),
        "model.norm.weight": torch.ones(hidden),
        "output.weight": torch.randn(vocab, hidden, generator=g),
    }
    config = {
        "architectures": ["InternLM2ForCausalLM"],
        "model_type": "internlm2",
        "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    return state, config


@pytest.mark.parametrize("left_out", [(), ("model.tok_embeddings.weight", "output.weight")])
def test_a_decoder_of_other_names_needs_a_tensor_of_its_vocabulary(tmp_path, capsys, left_out):
    """The embedding rule knew Llama's names only: an InternLM2-style checkpoint (and every
    ModernBERT) was refused as lacking ``model.embed_tokens.weight``. Other model types need
    some tensor of ``vocab_size`` rows instead."""
    state, config = _internlm2_like()
    _save_plain(tmp_path / "ck", {k: v for k, v in state.items() if k not in left_out})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    argv = ["--local_dir", str(tmp_path / "ck"), "--hf_model_path", str(tmp_path / "hf")]
    rc = cli.main(["merge", *argv, "--target_dir", str(tmp_path / "o"), "--trust-remote-code"])
    err = capsys.readouterr().err
    if not left_out:
        assert rc == 0, err
        assert_bit_identical(_load_merged(tmp_path / "o"), state)
        return
    assert rc == 1 and not (tmp_path / "o").exists(), err
    assert "holds no tensor of vocab_size 96 rows" in err and "ignore_frozen_params" in err, err


def test_a_modernbert_that_save_pretrained_wrote_verifies_and_merges(tmp_path, capsys):
    """ModernBERT's embedding is ``model.embeddings.tok_embeddings.weight`` beside
    ``model.layers.N``: verify failed save_pretrained's own output, merge refused it."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    model = ModernBertForMaskedLM(config)
    model.save_pretrained(tmp_path / "ref")
    assert cli.main(["verify", str(tmp_path / "ref")]) == 0, capsys.readouterr()
    argv = ["--local_dir", str(tmp_path / "ref"), "--target_dir", str(tmp_path / "o")]
    assert cli.main(["merge", *argv]) == 0, capsys.readouterr().err
    want = {k: v for k, v in model.state_dict().items() if k != "decoder.weight"}  # tied
    assert_bit_identical(_load_merged(tmp_path / "o"), want)


@pytest.mark.parametrize("apart", [False, True], ids=["equal", "trained-apart"])
def test_a_head_left_out_as_tied_is_said_in_a_note(tmp_path, capsys, apart):
    """Dropped as save_pretrained drops a tied head, which only --json said. With a config
    that ties it (the base model's, say), a head the run trained apart was lost unsaid: it is
    refused, naming both tensors, and nothing is written."""
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2", tie_word_embeddings=False)
    state = dict(build_tiny_model(config).state_dict())
    if not apart:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    _save_plain(tmp_path / "ck", state)
    config.tie_word_embeddings = True
    config.save_pretrained(tmp_path / "hf")
    argv = ["--local_dir", str(tmp_path / "ck"), "--target_dir", str(tmp_path / "o")]
    code = cli.main(["merge", *argv, "--hf_model_path", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    if apart:
        assert code == 1 and not (tmp_path / "o").exists()
        assert "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'" in err
        assert "the trained head would be lost" in err
    else:
        assert code == 0
        assert "note: left out lm_head.weight: " in err and "ties it to the input embedding" in err


def test_files_an_earlier_save_at_more_ranks_left_behind_are_not_the_checkpoints(tmp_path, capsys):
    """dcp.save over an older save at 3 ranks leaves __2_0.distcp, which .metadata does not
    name: the world size and files inspect reports are the new save's."""
    state = _plain_state()
    _save_plain(tmp_path / "ck", state)
    shutil.copyfile(tmp_path / "ck" / "__0_0.distcp", tmp_path / "ck" / "__2_0.distcp")
    ckpt = open_checkpoint(tmp_path / "ck")
    assert ckpt.world_size == 1
    assert [Path(f).name for f in ckpt.files] == ["__0_0.distcp"]
    assert cli.main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["world_size"], info["num_files"]) == (1, 1)


def test_single_process_dtype_cast_and_bytes_skipped(tmp_path):
    state = {"model": _plain_state(), "optim": {"step": 3, "lr": torch.tensor(0.1)}}
    _save_plain(tmp_path / "ck", state)
    ckpt = open_checkpoint(tmp_path / "ck")
    assert ckpt.skipped == {
        "optim.step": "not a tensor (pickled bytes)",
        "optim.lr": "training state (optim)",
    }
    _merge(tmp_path / "ck", tmp_path / "out", "--dtype", "float16")
    want = {k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()}
    assert_bit_identical(_load_merged(tmp_path / "out"), want)


def test_hf_names_keep_their_model_prefix_in_a_flat_state_dict(tmp_path):
    """A bare HF state dict's keys start with 'model.'; that is not a container to strip."""
    state = {"model.embed_tokens.weight": torch.ones(3, 2), "model.norm.weight": torch.ones(2)}
    _save_plain(tmp_path / "ck", state)
    assert sorted(t.name for t in open_checkpoint(tmp_path / "ck").tensors) == sorted(state)
    nested = {"model": state, "optimizer": {"state": {"x": torch.zeros(1)}}}
    _save_plain(tmp_path / "ck2", nested)
    assert sorted(t.name for t in open_checkpoint(tmp_path / "ck2").tensors) == sorted(state)


def test_a_submodule_named_state_beside_a_flattened_optimizer_stays_the_model_s(tmp_path):
    """``dcp.save({**model_sd, **flat_optim_sd})`` of a model with a submodule ``state``: its
    ``state.weight`` was taken for optimizer state, left out of the merge (exit 0) and called
    missing by restore. torch's own dcp.load restores it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import shardstream

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.state = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return self.state(self.embed(x))

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(4)).sum().backward()
    optimizer.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=flat)
    assert "state.weight" in model_sd and "state.state.weight.exp_avg" in optim_sd
    _save_plain(tmp_path / "ck", {**model_sd, **optim_sd})

    _merge(tmp_path / "ck", tmp_path / "out")
    assert_bit_identical(_load_merged(tmp_path / "out"), model.state_dict())

    torch.manual_seed(1)
    fresh = Net()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    shardstream.load(tmp_path / "ck", model=fresh, optimizer=fresh_optimizer)
    got_model, got_optim = get_state_dict(fresh, fresh_optimizer, options=flat)
    assert_bit_identical(got_model, model_sd)
    assert got_optim.keys() == optim_sd.keys()
    for key, value in optim_sd.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got_optim[key], value), key
        else:
            assert got_optim[key] == value, key


def test_entries_out_of_the_model_s_order_are_split_in_the_model_s_order(tmp_path):
    """A DCP checkpoint lists its entries in its global plan's order (here by name, as a
    state dict rebuilt by name gives): merged into several files, a model type that needs no
    mapping put other tensors in each file than save_pretrained (the input's order)."""
    pytest.importorskip("transformers")
    from integration.test_hf_layout import assert_same_model_files

    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    model = build_tiny_model(tiny_config("qwen2"), seed=0)
    model.save_pretrained(tmp_path / "reference", max_shard_size="8KB")
    assert len(list((tmp_path / "reference").glob("*.safetensors"))) > 2
    state = {k: v.contiguous().clone() for k, v in sorted(model.state_dict().items())}
    assert list(state) != list(model.state_dict())
    _save_plain(tmp_path / "ck", state)
    model.config.save_pretrained(tmp_path / "config")
    dtype = str(model.dtype).removeprefix("torch.")
    flags = ("--hf_model_path", str(tmp_path / "config"), "--max-shard-size", "8KB")
    _merge(tmp_path / "ck", tmp_path / "merged", *flags, "--dtype", dtype)
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")


def test_two_models_at_the_top_level_are_named_for_the_prefix_to_pick(tmp_path):
    """{"policy": ..., "ema": ...}: no container is called "model", so the refusal lists the
    containers the tensors lie under, and --prefix picks one."""
    state = {"model.embed_tokens.weight": torch.ones(3, 2), "model.norm.weight": torch.ones(2)}
    _save_plain(tmp_path / "ck", {"policy": state, "ema": {k: -v for k, v in state.items()}})
    with pytest.raises(CheckpointNotFoundError) as refused:
        open_checkpoint(tmp_path / "ck")
    assert "whose tensors lie under 'ema.' (2) and 'policy.' (2); pass the prefix" in str(
        refused.value
    )
    picked = open_checkpoint(tmp_path / "ck", prefix="ema.")
    assert sorted(t.name for t in picked.tensors) == sorted(state)


def test_optimizer_only_checkpoint_is_refused(tmp_path):
    _save_plain(tmp_path / "optimizer_0", {"optimizer": {"state": {"w": torch.zeros(2)}}})
    with pytest.raises(CheckpointNotFoundError, match="no model tensors"):
        open_checkpoint(tmp_path / "optimizer_0")


# --------------------------------------------------------------------------- hostile and corrupt


class _Touch:
    """Unpickling this runs ``exec`` that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _real_metadata(directory: Path):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # trusted: written by this test


def _write_metadata(directory: Path, metadata) -> None:
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("where", ["top", "planner_data", "storage_meta"])
def test_hostile_metadata_is_refused_and_runs_nothing(tmp_path, where):
    _save_plain(tmp_path / "ck", {"w": torch.ones(2, 2)})
    marker = tmp_path / "pwned"
    if where == "top":
        payload = _Touch(marker)
    else:
        payload = _real_metadata(tmp_path / "ck")
        setattr(payload, where, {"x": _Touch(marker)})
    _write_metadata(tmp_path / "ck", payload)
    # The payload is live: a plain unpickler would run it.
    pickle.loads(pickle.dumps(_Touch(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*builtins\.exec"):
        open_checkpoint(tmp_path / "ck")
    assert not marker.exists()
    rc = cli.main(
        ["merge", "--local_dir", str(tmp_path / "ck"), "--target_dir", str(tmp_path / "o")]
    )
    assert rc == 1
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_metadata_cannot_modify_the_reader_types(tmp_path):
    """BUILD on a class object (not an instance) would change it for every later load."""
    _save_plain(tmp_path / "ck", {"w": torch.ones(2, 2)})
    # GLOBAL Metadata; BUILD (None, {"version": "9"}) on the class itself.
    payload = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
        b"N}X\x07\x00\x00\x00versionX\x01\x00\x00\x009s\x86b."
    )
    (tmp_path / "ck" / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused.*modify Metadata"):
        open_checkpoint(tmp_path / "ck")
    assert dcp_pickles.Metadata.version is None


def test_hostile_chunk_record_is_refused(tmp_path):
    """A .distcp range holding a torch.save of a __reduce__ payload instead of a tensor."""
    _save_plain(tmp_path / "ck", {"w": torch.ones(2, 2)})
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Touch(marker), buf)
    (tmp_path / "ck" / "__0_9.distcp").write_bytes(buf.getvalue())
    meta = _real_metadata(tmp_path / "ck")
    for info in meta.storage_data.values():
        info.relative_path, info.offset, info.length = "__0_9.distcp", 0, len(buf.getvalue())
    _write_metadata(tmp_path / "ck", meta)
    with pytest.raises(UnsafeCheckpointError, match=r"__0_9\.distcp: refused.*exec"):
        open_checkpoint(tmp_path / "ck")
    assert not marker.exists()


def test_a_chunk_record_naming_its_storage_twice_is_refused(tmp_path):
    """The storage record listed twice in a chunk's zip directory, the second copy zeros: the
    last copy was read (zeros merged, exit 0) where torch's dcp.load reads the first."""
    import zipfile

    from shardstream.commands.verify import verify

    _save_plain(tmp_path / "ck", {"w": torch.arange(6.0).reshape(2, 3)})
    meta = _real_metadata(tmp_path / "ck")
    (info,) = meta.storage_data.values()
    data = tmp_path / "ck" / info.relative_path
    raw = data.read_bytes()
    record = zipfile.ZipFile(io.BytesIO(raw[info.offset : info.offset + info.length]))
    entries = [(i.filename, record.read(i.filename)) for i in record.infolist()]
    entries += [(n, bytes(len(b))) for n, b in entries if n.endswith("/data/0")]
    rebuilt = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_STORED) as out:
        warnings.simplefilter("ignore")  # "Duplicate name"
        for name, body in entries:
            out.writestr(zipfile.ZipInfo(name), body)
    data.write_bytes(raw + rebuilt.getvalue())
    info.offset, info.length = len(raw), len(rebuilt.getvalue())
    _write_metadata(tmp_path / "ck", meta)
    with pytest.raises(CheckpointFormatError, match=r"holds record '.*data/0' twice"):
        open_checkpoint(tmp_path / "ck")
    assert any("twice" in p.line() for p in verify(tmp_path / "ck").problems)


def _corrupt(tmp_path: Path, edit) -> Path:
    _save_plain(tmp_path / "ck", {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3)})
    meta = _real_metadata(tmp_path / "ck")
    edit(meta, tmp_path / "ck")
    _write_metadata(tmp_path / "ck", meta)
    return tmp_path / "ck"


def _storage(meta, fqn: str):
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn)


def test_storage_path_escaping_the_directory_is_refused(tmp_path):
    def edit(meta, _):
        _storage(meta, "w").relative_path = "../../etc/passwd"

    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        open_checkpoint(_corrupt(tmp_path, edit))


def test_transformed_chunks_are_refused(tmp_path):
    def edit(meta, _):
        _storage(meta, "w").transform_descriptors = ["stream.zstd/1"]

    with pytest.raises(CheckpointFormatError, match=r"stream\.zstd/1.*cannot read transformed"):
        open_checkpoint(_corrupt(tmp_path, edit))


def _run_cli(*argv, child: bool = False) -> tuple[int, list[str]]:
    """``shardstream ARGV``'s exit code and stderr's lines: in this process (an uncaught
    error raises here), or with ``child`` as ``python -m shardstream`` in a child process."""
    if child:
        done = run_cli(*argv)
        return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main([str(a) for a in argv])
    return code, [line for line in err.getvalue().splitlines() if line.strip()]


def _refused_in_one_line(ckpt: Path, tmp_path: Path, *needles: str, child: bool = False) -> None:
    """inspect, merge and verify each end with exit 1 and one line naming ``.metadata``
    (``child``: each in a process of its own, as a user runs them)."""
    meta_path = str(ckpt / ".metadata")
    target = tmp_path / "merged"
    for argv in (
        ["inspect", ckpt],
        ["merge", "--local_dir", ckpt, "--target_dir", target, "--quiet"],
        ["verify", "--quiet", ckpt],
    ):
        code, lines = _run_cli(*argv, child=child)
        assert code == 1 and len(lines) == 1, (argv[0], code, lines)
        assert "Traceback" not in lines[0] and meta_path in lines[0], (argv[0], lines)
        for needle in needles:
            assert needle in lines[0], (argv[0], needle, lines)
        assert not target.exists()


@pytest.mark.parametrize(
    "value", [5, True, 1.5, "stream.zstd/1", {"a": 1}], ids=["int", "bool", "float", "str", "dict"]
)
def test_transform_descriptors_that_are_no_list_are_one_line_errors(tmp_path, value):
    """Found by the soak's structure-aware fuzzer: an int there made the error message itself
    raise a TypeError (``list(5)``) from inside the reader."""

    def edit(meta, _):
        _storage(meta, "w").transform_descriptors = value

    ckpt = _corrupt(tmp_path, edit)
    with pytest.raises(CheckpointFormatError, match="not a list of transform names"):
        open_checkpoint(ckpt)
    needles = ("'w' has transform_descriptors", "not a list")
    _refused_in_one_line(ckpt, tmp_path, *needles, child=type(value) is int)


def _set(obj, field: str, value) -> None:
    object.__setattr__(obj, field, value)  # DCP's MetadataIndex is a frozen dataclass


WRONG_FIELDS = {
    # the other fields of StorageInfo, ChunkStorageMetadata, TensorStorageMetadata and the
    # storage_data keys: each refused in one line naming .metadata
    "storage file a lone surrogate": (
        lambda meta: _set(_storage(meta, "w"), "relative_path", "\ud800.distcp"),
        "not a plain file name",
    ),
    "storage file with a NUL": (
        lambda meta: _set(_storage(meta, "w"), "relative_path", "__0_0\x00.distcp"),
        "not a plain file name",
    ),
    "storage offset a string": (
        lambda meta: _set(_storage(meta, "w"), "offset", "0"),
        "invalid byte range",
    ),
    "chunk offsets an int": (
        lambda meta: _set(meta.state_dict_metadata["w"].chunks[0], "offsets", 5),
        "'w' chunk offsets is a int",
    ),
    "chunk sizes an int": (
        lambda meta: _set(meta.state_dict_metadata["w"].chunks[0], "sizes", 5),
        "'w' chunk sizes is a int",
    ),
    "tensor size an int": (
        lambda meta: _set(meta.state_dict_metadata["w"], "size", 5),
        "'w' shape is 5",
    ),
    "tensor size beyond torch's": (
        lambda meta: _set(meta.state_dict_metadata["w"], "size", (0, 2**64)),
        "'w' has an invalid shape [0, 18446744073709551616]",
    ),
    "tensor dtype a long string": (
        lambda meta: _set(meta.state_dict_metadata["w"].properties, "dtype", "x" * 10_000),
        "unsupported dtype",
    ),
    "storage key offset an int": (
        lambda meta: _set(next(k for k in meta.storage_data if k.fqn == "w"), "offset", 5),
        "chunk offset is 5",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_FIELDS))
def test_metadata_fields_of_the_wrong_type_are_one_line_errors(tmp_path, case):
    edit, needle = WRONG_FIELDS[case]
    ckpt = _corrupt(tmp_path, lambda meta, _: edit(meta))
    _refused_in_one_line(ckpt, tmp_path, needle)


def test_a_chunk_listed_many_times_is_refused_before_any_record_is_read(tmp_path, monkeypatch):
    """One chunk referenced 100,000 times (a few hundred bytes of .metadata): each reference's
    record was parsed (minutes) before the element count refused it."""
    from shardstream.formats import dcp

    def repeated(meta, _):
        md = meta.state_dict_metadata["w"]
        md.chunks = md.chunks[:1] * 100_000

    ckpt = _corrupt(tmp_path, repeated)
    read = []
    real = dcp.read_chunk_layout
    monkeypatch.setattr(dcp, "read_chunk_layout", lambda *a: read.append(a) or real(*a))
    with pytest.raises(CheckpointFormatError, match=r"shards hold \d+ elements.*100000 chunks"):
        open_checkpoint(ckpt)
    assert read == []


def test_chunks_that_do_not_tile_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def gap(meta, _):
        meta.state_dict_metadata["w"].size = torch.Size([8, 3])  # 4 saved rows can't cover 8

    with pytest.raises(CheckpointFormatError, match="'w': shards hold 12 elements.*needs 24"):
        open_checkpoint(_corrupt(tmp_path / "gap", gap))

    def overlap(meta, _):
        md = meta.state_dict_metadata["w"]
        md.size = torch.Size([8, 3])
        md.chunks.append(ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([4, 3])))
        meta.storage_data[MetadataIndex("w", [1, 0])] = _storage(meta, "w")

    with pytest.raises(CheckpointFormatError, match="'w': shards .* overlap"):
        open_checkpoint(_corrupt(tmp_path / "overlap", overlap))

    def missing(meta, _):
        meta.state_dict_metadata["w"].chunks[0].offsets = torch.Size([2, 0])

    with pytest.raises(CheckpointFormatError, match=r"'w' at offsets \[2, 0\] has no storage"):
        open_checkpoint(_corrupt(tmp_path / "missing", missing))


@pytest.mark.parametrize("field", ["offsets", "sizes"])
def test_chunk_extents_that_are_not_sequences_are_refused(tmp_path, field):
    """Found by `make soak`'s fuzzing: a flipped byte turned a chunk's offsets into a bare
    reference to an allowed callable (no call), and reading it raised a TypeError."""

    def edit(meta, _):
        setattr(meta.state_dict_metadata["w"].chunks[0], field, torch.Size)  # the class itself

    with pytest.raises(CheckpointFormatError, match=rf"'w' chunk {field} is a .*not a tuple"):
        open_checkpoint(_corrupt(tmp_path, edit))


def test_chunk_shape_or_dtype_disagreeing_with_record_is_refused(tmp_path):
    def edit(meta, _):
        meta.state_dict_metadata["w"].properties.dtype = torch.float64

    with pytest.raises(CheckpointFormatError, match="holds F32, but .metadata says F64"):
        open_checkpoint(_corrupt(tmp_path, edit))


def test_unsupported_dtype_is_refused(tmp_path):
    def edit(meta, _):
        meta.state_dict_metadata["w"].properties.dtype = torch.complex128

    with pytest.raises(CheckpointFormatError, match="'w' has unsupported dtype torch.complex128"):
        open_checkpoint(_corrupt(tmp_path, edit))


def test_range_past_end_of_file_is_refused(tmp_path):
    def edit(meta, directory):
        info = _storage(meta, "b")
        info.offset = (directory / info.relative_path).stat().st_size - 10

    with pytest.raises(CheckpointFormatError, match="truncated: tensor 'b'"):
        open_checkpoint(_corrupt(tmp_path, edit))


def test_truncated_data_file_is_refused(tmp_path):
    _save_plain(tmp_path / "ck", {"w": torch.ones(64, 64)})
    data = tmp_path / "ck" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp: truncated"):
        open_checkpoint(tmp_path / "ck")


def test_garbage_in_chunk_range_is_refused(tmp_path):
    _save_plain(tmp_path / "ck", {"w": torch.ones(64, 64)})
    data = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200:] = b"\0" * 200  # wipe the zip's central directory
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="not a readable torch.save archive"):
        open_checkpoint(tmp_path / "ck")


def test_missing_data_file_and_missing_metadata(tmp_path):
    _save_plain(tmp_path / "ck", {"w": torch.ones(2)})
    (tmp_path / "ck" / "__0_0.distcp").rename(tmp_path / "elsewhere")
    with pytest.raises(CheckpointNotFoundError, match=r"__0_0\.distcp: missing DCP data file"):
        open_checkpoint(tmp_path / "ck")
    (tmp_path / "elsewhere").rename(tmp_path / "ck" / "__0_0.distcp")
    (tmp_path / "ck" / ".metadata").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no .metadata"):
        open_checkpoint(tmp_path / "ck")


def test_garbage_metadata_is_a_format_error(tmp_path):
    _save_plain(tmp_path / "ck", {"w": torch.ones(2)})
    (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointFormatError, match=r"\.metadata.*not readable"):
        open_checkpoint(tmp_path / "ck")
    _write_metadata(tmp_path / "ck", {"state_dict_metadata": {}})
    with pytest.raises(CheckpointFormatError, match="expected DCP Metadata"):
        open_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("tail", [bytes(1 << 20), b"more.", b"."], ids=["zeros", "dot", "stop"])
def test_bytes_after_the_metadata_pickle_are_refused(tmp_path, tail):
    """Bytes appended to .metadata were ignored (exit 0), a sparse gigabyte of zeros read
    whole into memory first; refused now, zeros before the file is read."""
    from shardstream.commands.verify import verify

    _save_plain(tmp_path / "ck", {"w": torch.ones(2, 2)})
    with open(tmp_path / "ck" / ".metadata", "ab") as f:
        f.write(tail)
    words = "pickle's end" if tail.endswith(b".") else "does not end as a pickle does"
    with pytest.raises(CheckpointFormatError, match=words):
        open_checkpoint(tmp_path / "ck")
    assert any(words in p.line() for p in verify(tmp_path / "ck").problems)


def test_safetensors_serialization_format_is_refused_clearly(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    _save_plain(
        tmp_path / "ck",
        {"w": torch.ones(2, 2)},
        serialization_format=SerializationFormat.SAFETENSORS,
    )
    with pytest.raises(CheckpointFormatError, match="safetensors serialization"):
        open_checkpoint(tmp_path / "ck")


def test_detection(tmp_path):
    assert not is_dcp_checkpoint(tmp_path)
    (tmp_path / "__0_0.distcp").write_bytes(b"")
    assert is_dcp_checkpoint(tmp_path)


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "worker":
    from shardstream.testing.distributed import exit_finished_rank

    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    exit_finished_rank()


def test_restore_refuses_model_tensors_the_live_model_lacks(tmp_path):
    """A DCP model state of another model (one with biases the live one lacks): refused
    before anything is written, naming a tensor, as torch's strict load_state_dict does."""
    import shardstream

    saved = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    _save_plain(tmp_path / "ck", {"model": saved.state_dict()})
    live = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=r"has model tensor '0\.bias'.*the model lacks"):
        shardstream.load(tmp_path / "ck", model=live, contents=("model",))
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())


def test_metadata_over_the_size_limit_is_refused_unread(tmp_path):
    """A .metadata claiming more than MAX_METADATA_BYTES (a sparse file here) is refused in
    one line before any of it is read, not a MemoryError."""
    from shardstream.formats.dcp_pickles import MAX_METADATA_BYTES

    ckpt = tmp_path / "ck"
    _save_plain(ckpt, {"w": torch.ones(2)})
    with open(ckpt / ".metadata", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)
    _refused_in_one_line(ckpt, tmp_path, f"over the {MAX_METADATA_BYTES} bytes")


def test_a_checkpoint_saved_without_crc32s_is_read(tmp_path, capsys):
    """torch.serialization.set_crc32_options(False) makes every item's records hold a CRC-32
    of 0, which torch reads: merge refused each chunk ("Bad CRC-32 for file
    'archive/byteorder'")."""
    state = _plain_state()
    torch.serialization.set_crc32_options(False)
    try:
        _save_plain(tmp_path / "ck", state)
    finally:
        torch.serialization.set_crc32_options(True)
    assert cli.main(["verify", str(tmp_path / "ck")]) == 0, capsys.readouterr()
    _merge(tmp_path / "ck", tmp_path / "out")
    assert_bit_identical(_load_merged(tmp_path / "out"), state)


def test_a_quantized_model_keeps_its_float32_scales(tmp_path, capsys):
    """An FP8 model (float8 weights, float32 ``weight_scale_inv`` block scales, config.json
    naming bfloat16 and a ``quantization_config``) merged with no flags had its scales cast to
    bfloat16, changing every dequantised weight; transformers keeps them float32."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    weights = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 8, generator=g).to(
            torch.float8_e4m3fn
        ),
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.rand(1, 1, generator=g) + 0.1,
        "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
    }
    source = tmp_path / "fp8"
    source.mkdir()
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    config = {
        "dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    (source / "config.json").write_text(json.dumps(config))
    argv = ["merge", "--local_dir", str(source), "--target_dir", str(tmp_path / "o")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    merged = _load_merged(tmp_path / "o")
    assert {k: v.dtype for k, v in merged.items()} == {k: v.dtype for k, v in weights.items()}
    for name, tensor in weights.items():
        assert torch.equal(merged[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_frozen_vision_tower_left_out_is_refused(tmp_path, capsys):
    """``get_state_dict(..., ignore_frozen_params=True)`` of a VLM whose vision tower was
    frozen: merge wrote the language model alone (exit 0, no note), and transformers started
    the whole tower at random. The model transformers builds for the layout says what
    save_pretrained writes; a part of it the checkpoint holds nothing of is refused."""
    from shardstream.testing.tiny_models import build_layout_model, layout_config

    model = build_layout_model("qwen2_5_vl")
    state = {k: v for k, v in model.state_dict().items() if ".visual." not in f".{k}"}
    assert len(state) < len(model.state_dict())
    _save_plain(tmp_path / "ck", state)
    layout_config("qwen2_5_vl").save_pretrained(tmp_path / "hf")
    argv = ["--local_dir", str(tmp_path / "ck"), "--hf_model_path", str(tmp_path / "hf")]
    for _ in range(2):  # the second plan comes from the layout cache
        rc = cli.main(["merge", *argv, "--target_dir", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 1 and not (tmp_path / "o").exists(), err
        assert "holds nothing of visual.*" in err and "ignore_frozen_params" in err, err
    rc = cli.main(["merge", *argv, "--target_dir", str(tmp_path / "o"), "--keep-names"])
    assert rc == 0, capsys.readouterr().err  # the in-memory names, on purpose


def test_a_critic_of_a_mapped_model_type_whose_config_names_the_causal_lm_merges(tmp_path, capsys):
    """A verl critic (``score`` head) of a model type transformers maps, saved with the
    actor's ``*ForCausalLM`` config.json: its missing ``lm_head`` is not a part left out."""
    import transformers

    from shardstream.testing.tiny_models import layout_config, randomized

    config = layout_config("qwen3_moe")
    config.num_labels = 1
    state = dict(randomized(transformers.Qwen3MoeForTokenClassification(config)).state_dict())
    assert "score.weight" in state and "lm_head.weight" not in state
    _save_plain(tmp_path / "ck", state)
    config.save_pretrained(tmp_path / "hf")  # architectures: Qwen3MoeForCausalLM
    argv = ["--local_dir", str(tmp_path / "ck"), "--hf_model_path", str(tmp_path / "hf")]
    rc = cli.main(["merge", *argv, "--target_dir", str(tmp_path / "o"), "--dtype", "float32"])
    assert rc == 0, capsys.readouterr().err
    assert "score.weight" in _load_merged(tmp_path / "o")


def test_a_second_model_beside_the_model_is_said_not_read(tmp_path, capsys):
    """``dcp.save({"model", "ema", "optim"})``: merge wrote ``model.*`` without a word about
    the EMA copy beside it; merge's summary and inspect now name it and the flag that reads it.
    Training state (the optimizer, a recipe's ``app.optim``) is not named."""
    import torch.distributed.checkpoint as dcp

    from shardstream.formats.dcp import unread_groups

    weights = {"0.weight": torch.ones(4, 4), "0.bias": torch.ones(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        state = {"model": dict(weights), "ema": dict(weights), "optim": {"lr": torch.ones(2)}}
        dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    assert cli.main(["merge", "--local_dir", str(tmp_path / "ck"), "--target_dir",
                     str(tmp_path / "out")]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "also holds 2 tensors under 'ema.'" in err and "--prefix ema. merges those" in err
    assert cli.main(["inspect", str(tmp_path / "ck")]) == 0
    assert "not read: ema.* (2 tensors; --prefix ema. reads them" in capsys.readouterr().out
    recipe = {"app.model.w": "", "app.optim.state.w.exp_avg": "training state (app)"}
    recipe["app.ema.w"] = recipe["app.ema.b"] = "training state (app)"
    assert unread_groups(recipe, "app.model.") == {"app.ema.": 2}
    assert unread_groups({"optimizer.state.w": "training state (optimizer)"}, "") == {}


def test_a_checkpoint_without_config_is_compared_in_the_references_layout(tmp_path):
    """A DCP checkpoint holds no config.json: `shardstream test` of a Qwen3-MoE (fused
    experts in memory) against save_pretrained's per-expert files listed every expert as
    missing and unexpected. The reference's config.json now describes the model compared."""
    import transformers
    from safetensors.torch import load_file

    from shardstream.commands.test import compare_with_reference
    from shardstream.testing.tiny_models import layout_config, randomized

    model = randomized(transformers.Qwen3MoeForCausalLM(layout_config("qwen3_moe")))
    _save_plain(tmp_path / "ck", dict(model.state_dict()))
    model.save_pretrained(tmp_path / "ref")
    report = compare_with_reference(tmp_path / "ck", tmp_path / "ref", exact=True)
    assert report.ok, report.problems
    assert report.compared == len(load_file(tmp_path / "ref" / "model.safetensors"))
