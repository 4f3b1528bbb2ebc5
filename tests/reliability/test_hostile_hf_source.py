"""Damaged Hugging Face model directories given to ``shardstream merge`` as its source.

A HF safetensors model (``model.safetensors``, or an index and its shard files) is read as whole
tensors and written out as ``save_pretrained`` would. Each case below builds a small real model
with the safetensors library (or with merge itself, for files that carry shardstream's chunk
checksums), damages it, and runs the CLI in-process: it must exit non-zero with one line naming
the file (or tensor), no traceback, no target nor ``.tmp-`` leftover written, and the source
untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from shardstream import cli

from .harness import tree_contents
from .test_hostile import HOSTILE_FILES

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
LAYER = "model.layers.0."
Q_PROJ, O_PROJ = LAYER + "self_attn.q_proj.weight", LAYER + "self_attn.o_proj.weight"
GATE, DOWN = LAYER + "mlp.gate_proj.weight", LAYER + "mlp.down_proj.weight"
CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
SHAPES = {
    "model.embed_tokens.weight": (64, 16),
    Q_PROJ: (16, 16),
    LAYER + "self_attn.q_proj.bias": (16,),
    LAYER + "self_attn.k_proj.weight": (8, 16),
    LAYER + "self_attn.k_proj.bias": (8,),
    LAYER + "self_attn.v_proj.weight": (8, 16),
    LAYER + "self_attn.v_proj.bias": (8,),
    O_PROJ: (16, 16),
    GATE: (32, 16),
    LAYER + "mlp.up_proj.weight": (32, 16),
    DOWN: (16, 32),
    LAYER + "input_layernorm.weight": (16,),
    LAYER + "post_attention_layernorm.weight": (16,),
    "model.norm.weight": (16,),
    "lm_head.weight": (64, 16),
}


# --- building and damaging models ---------------------------------------------------------------


def _state() -> dict[str, torch.Tensor]:
    """The tensors of Qwen2ForCausalLM for CONFIG, under the names save_pretrained writes."""
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _single(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(_state(), str(directory / SINGLE), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def _sharded(directory: Path) -> Path:
    """Two shard files and their index, as save_pretrained splits a model."""
    from safetensors.torch import save_file

    def write(part: dict, path: Path) -> None:
        save_file(part, str(path), metadata={"format": "pt"})

    write_halves(directory, _state(), (FIRST, SECOND), INDEX, write)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def write_halves(directory: Path, state: dict, files: tuple[str, str], index: str, write) -> None:
    """``state`` split in two files by sorted name, ``write(part, path)`` each, and the index
    (``weight_map`` and ``total_size``) as transformers writes it."""
    directory.mkdir(parents=True)
    names = sorted(state)
    weight_map = {}
    for file, part in zip(files, (names[: len(names) // 2], names[len(names) // 2 :])):
        write({n: state[n] for n in part}, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.nbytes for t in state.values())
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / index).write_text(json.dumps(doc))


def _checksummed(tmp_path: Path, *extra: str) -> Path:
    """A model merge wrote: its files carry shardstream's chunk checksums in their headers."""
    plain = _single(tmp_path / "plain")
    source = tmp_path / "ck"
    argv = ["merge", "--local_dir", str(plain), "--target_dir", str(source), "--quiet", *extra]
    assert cli.main(argv) == 0
    shutil.rmtree(plain)
    return source


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write(path: Path, header: dict | bytes, data: bytes) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _edit(path: Path, change) -> None:
    """Rewrite ``path``'s header after ``change(header)``; the data stays as it was."""
    header, data = _read(path)
    change(header)
    _write(path, header, data)


def _edit_index(source: Path, change) -> None:
    index = json.loads((source / INDEX).read_text())
    change(index)
    (source / INDEX).write_text(json.dumps(index))


def _flip(path: Path, at: int) -> None:
    """Flip one bit of data byte ``at`` (counted from the end of the header)."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    raw[8 + length + at] ^= 0x01
    path.write_bytes(bytes(raw))


# --- running the CLI ----------------------------------------------------------------------------


def _run(capsys, command: str, source: Path, target: Path, *extra: str) -> tuple[int, str]:
    argv = {
        "merge": ["merge", "--local_dir", source, "--target_dir", target, "--quiet", *extra],
        "inspect": ["inspect", source],
        "verify": ["verify", "--quiet", source],
    }[command]
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _refused(
    capsys,
    source: Path,
    tmp_path: Path,
    *needles: str,
    command: str = "merge",
    extra: tuple[str, ...] = (),
    target: Path | None = None,
) -> str:
    """``command`` exits non-zero with one error line naming every needle and no traceback;
    merge writes no target and leaves no ``.tmp-`` directory beside it; the source (and all
    else under ``tmp_path``) is as it was."""
    target = target if target is not None else tmp_path / "merged"
    existed = target.exists()
    before = tree_contents(tmp_path)
    code, err = _run(capsys, command, source, target, *extra)
    assert code != 0, (command, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    if command != "verify":
        assert len(lines) == 1 and lines[0].startswith(f"shardstream {command}: error: "), lines
    for needle in needles:
        assert needle in err, (command, needle, err)
    if not existed:
        assert not target.exists(), err
    assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]
    assert tree_contents(tmp_path) == before
    return err


# --- safetensors headers that lie ------------------------------------------------------------


@pytest.mark.parametrize("where", ["single", "shard"])
@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_hostile_safetensors_file_in_a_model(tmp_path, capsys, case, where):
    """test_hostile's hostile files (overlapping offsets, holes, a header length of 2**64-1,
    duplicate names, negative shapes, deep nesting, ...), as a model's only file or as a
    shard its index names: merge refuses, naming the file."""
    if where == "single":
        source = _single(tmp_path / "hf")
        bad = source / SINGLE
    else:
        source = _sharded(tmp_path / "hf")
        bad = source / SECOND
        _edit_index(source, lambda index: index["weight_map"].update(a=SECOND, w=SECOND))
    bad.write_bytes(HOSTILE_FILES[case]())
    _refused(capsys, source, tmp_path, str(bad))


def _truncated_mid_tensor(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _offsets_as_floats(path: Path) -> None:
    _edit(
        path, lambda h: h[Q_PROJ].update(data_offsets=[float(x) for x in h[Q_PROJ]["data_offsets"]])
    )


def _dtype_not_a_string(path: Path) -> None:
    _edit(path, lambda h: h[Q_PROJ].update(dtype=["F32"]))


def _metadata_a_list(path: Path) -> None:
    _edit(path, lambda h: h.update(__metadata__=["pt"]))


def _integer_of_5000_digits(path: Path) -> None:
    header, data = _read(path)
    body = (
        json.dumps(header).encode().replace(b'"shape": [16]', b'"shape": [1' + b"0" * 5000 + b"]")
    )
    _write(path, body, data)


def _overlapping_real_tensors(path: Path) -> None:
    _edit(path, lambda h: h[O_PROJ].update(data_offsets=list(h[Q_PROJ]["data_offsets"])))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_truncated_mid_tensor, "truncated"),
        (_offsets_as_floats, f"tensor {Q_PROJ!r} has invalid data_offsets"),
        (_dtype_not_a_string, f"tensor {Q_PROJ!r} has unknown dtype"),
        (_metadata_a_list, "__metadata__ must map strings to strings"),
        (_integer_of_5000_digits, "not valid JSON"),
        (_overlapping_real_tensors, "leaves a hole"),
    ],
    ids=["truncated", "float_offsets", "dtype_list", "metadata_list", "5000_digits", "overlap"],
)
def test_header_of_a_real_model_that_lies(tmp_path, capsys, damage, needle):
    source = _single(tmp_path / "hf")
    damage(source / SINGLE)
    _refused(capsys, source, tmp_path, str(source / SINGLE), needle)


def test_tensor_name_with_a_lone_surrogate(tmp_path, capsys):
    """JSON spells a lone surrogate "\\ud800"; no safetensors reader parses such a name, and
    the merge would write one: refused, naming the tensor."""
    source = _single(tmp_path / "hf")
    header, data = _read(source / SINGLE)
    body = json.dumps(header).encode().replace(b'"model.norm.weight"', b'"model.norm.\\ud800"')
    _write(source / SINGLE, body, data)
    _refused(capsys, source, tmp_path, "model.norm.\\ud800", "not valid Unicode")


def test_two_names_that_are_one_once_wrappers_are_stripped(tmp_path, capsys):
    """``_orig_mod.model.norm.weight`` beside ``model.norm.weight`` (other values): both would
    be written as model.norm.weight."""
    source = _single(tmp_path / "hf")

    def add(header: dict) -> None:
        entry = header["model.norm.weight"]
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        header["_orig_mod.model.norm.weight"] = {**entry, "data_offsets": [end, end + 64]}

    header, data = _read(source / SINGLE)
    add(header)
    _write(source / SINGLE, header, data + b"\x01" * 64)
    _refused(capsys, source, tmp_path, "'model.norm.weight'", "'_orig_mod.model.norm.weight'")


def test_model_file_with_no_tensors(tmp_path, capsys):
    source = _single(tmp_path / "hf")
    _write(source / SINGLE, {"__metadata__": {"format": "pt"}}, b"")
    _refused(capsys, source, tmp_path, str(source), "holds no model tensors")


# --- indexes that lie --------------------------------------------------------------------------


def _first_of_second(index: dict) -> str:
    return min(n for n, f in index["weight_map"].items() if f == SECOND)


@pytest.mark.parametrize(
    "name",
    ["../x.safetensors", "/abs/x.safetensors", ".", "", "sub/x.safetensors", "a\0b.safetensors"],
    ids=["dotdot", "absolute", "dot", "empty", "folder", "nul"],
)
def test_weight_map_naming_no_plain_file_of_the_directory(tmp_path, capsys, name):
    source = _sharded(tmp_path / "hf")
    if name.startswith(".."):
        shutil.copyfile(source / SECOND, tmp_path / "x.safetensors")  # what an escape would read
    _edit_index(source, lambda index: index["weight_map"].update({_first_of_second(index): name}))
    _refused(capsys, source, tmp_path, str(source / INDEX), "not a plain file name")


def test_weight_map_naming_a_missing_file(tmp_path, capsys):
    source = _sharded(tmp_path / "hf")
    missing = "model-00003-of-00003.safetensors"
    _edit_index(
        source, lambda index: index["weight_map"].update({_first_of_second(index): missing})
    )
    _refused(capsys, source, tmp_path, str(source / missing), "no such file")


@pytest.mark.parametrize("name", [INDEX, "config.json"])
def test_weight_map_naming_a_json_file(tmp_path, capsys, name):
    """The index (or config.json) read as a shard: its first 8 bytes as a header length."""
    source = _sharded(tmp_path / "hf")
    _edit_index(source, lambda index: index["weight_map"].update({_first_of_second(index): name}))
    _refused(capsys, source, tmp_path, str(source / name), "header length")


@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_weight_map_listing_a_tensor_its_file_lacks(tmp_path, capsys, command):
    source = _sharded(tmp_path / "hf")
    ghost = LAYER + "ghost.weight"
    _edit_index(source, lambda index: index["weight_map"].update({ghost: SECOND}))
    _refused(capsys, source, tmp_path, str(source / INDEX), repr(ghost), command=command)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "holds a list"),
        ("[" * 100_000, "not valid JSON"),
        ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON"),
        ('{"metadata": {}}', "weight_map"),
        ('{"weight_map": [["a", "b"]]}', "weight_map must map"),
        ('{"weight_map": {"a": 7}}', "weight_map must map"),
        ('{"metadata": {"total_size": 1' + "0" * 30 + '}, "weight_map": {}}', "31 digits"),
        (b'{"weight_map": {"\xff": "x"}}', "not valid JSON"),
    ],
    ids=[
        "not_json",
        "list",
        "deep",
        "deep_weight_map",
        "no_weight_map",
        "weight_map_list",
        "file_not_a_string",
        "huge_integer",
        "not_utf8",
    ],
)
def test_index_that_is_no_index(tmp_path, capsys, text, needle):
    """test_hostile_inputs covers inspect and verify of such indexes; this is merge."""
    source = _sharded(tmp_path / "hf")
    raw = text if isinstance(text, bytes) else text.encode()
    (source / INDEX).write_bytes(raw)
    _refused(capsys, source, tmp_path, str(source / INDEX), needle)


def test_both_a_single_file_and_an_index(tmp_path, capsys):
    """transformers loads model.safetensors, vLLM the index's files: neither is taken."""
    from safetensors.torch import save_file

    source = _sharded(tmp_path / "hf")
    save_file({"w": torch.zeros(2)}, str(source / SINGLE))
    _refused(capsys, source, tmp_path, str(source), f"{SINGLE} and {INDEX}", "ambiguous")


# --- shard files that are no regular file ----------------------------------------------------


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _broken_link(path: Path) -> None:
    path.symlink_to("nowhere")


def _link_loop(path: Path) -> None:
    path.symlink_to(path.name)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


@pytest.mark.parametrize(
    "replace, needle",
    [
        (_fifo, "is a FIFO"),
        (_directory, "is a directory"),
        (_broken_link, "no such file"),
        (_link_loop, "symbolic links"),
        (_dev_zero, "outside the checkpoint"),  # a link to /dev/zero leads out of the model
    ],
    ids=["fifo", "directory", "broken_link", "link_loop", "dev_zero"],
)
def test_shard_that_is_no_regular_file(tmp_path, capsys, replace, needle):
    """test_hostile_campaign covers inspect and test of a FIFO or looping shard; this is
    merge, which must neither block on a FIFO nor read /dev/zero without end."""
    source = _sharded(tmp_path / "hf")
    (source / SECOND).unlink()
    replace(source / SECOND)
    _refused(capsys, source, tmp_path, str(source / SECOND), needle)


# --- files with shardstream's checksums ------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [(), ("--dtype", "bfloat16")], ids=["as_stored", "cast_to_bfloat16"]
)
@pytest.mark.parametrize("at", [0, 5000, -1], ids=["first_byte", "middle", "last_byte"])
def test_checksummed_model_with_a_flipped_data_bit(tmp_path, capsys, at, extra):
    source = _checksummed(tmp_path)
    path = source / SINGLE
    if at == -1:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(bytes(raw))
    else:
        _flip(path, at)
    _refused(capsys, source, tmp_path, str(path), "checksum mismatch", extra=extra)


def test_checksummed_shard_with_a_flipped_data_bit(tmp_path, capsys):
    """Three files: the mismatch names the damaged one, not the first or the directory."""
    source = _checksummed(tmp_path, "--max-shard-size", "8KB")
    damaged = source / "model-00003-of-00003.safetensors"
    assert damaged.is_file() and (source / INDEX).is_file()
    _flip(damaged, 100)
    err = _refused(capsys, source, tmp_path, str(damaged), "checksum mismatch")
    assert "model-00001-of-00003" not in err


def _rename(header: dict) -> None:
    header[Q_PROJ + "_renamed"] = header.pop(Q_PROJ)


def _swap_offsets(header: dict) -> None:
    """q_proj and o_proj: same shape and dtype, each now reads the other's bytes."""
    header[Q_PROJ]["data_offsets"], header[O_PROJ]["data_offsets"] = (
        header[O_PROJ]["data_offsets"],
        header[Q_PROJ]["data_offsets"],
    )


def _swap_shapes(header: dict) -> None:
    """gate_proj [32, 16] and down_proj [16, 32]: same size, each transposed-looking."""
    header[GATE]["shape"], header[DOWN]["shape"] = header[DOWN]["shape"], header[GATE]["shape"]


def _to_int32(header: dict) -> None:
    header[Q_PROJ]["dtype"] = "I32"


@pytest.mark.parametrize(
    "change",
    [_rename, _swap_offsets, _swap_shapes, _to_int32],
    ids=["renamed", "offsets_swapped", "shapes_swapped", "dtype_same_size"],
)
def test_checksummed_header_altered_with_its_metadata_kept(tmp_path, capsys, change):
    source = _checksummed(tmp_path)
    _edit(source / SINGLE, change)
    _refused(capsys, source, tmp_path, str(source / SINGLE), "header altered")


PREFIX = "shardstream."


def _meta(change):
    return lambda header: change(header["__metadata__"])


@pytest.mark.parametrize(
    "change, needle",
    [
        (_meta(lambda m: m.pop(PREFIX + "chunks")), "damaged checksum metadata"),
        (_meta(lambda m: m.pop(PREFIX + "entries")), "damaged checksum metadata"),
        (_meta(lambda m: m.update({PREFIX + "algorithm": "md5"})), "unknown algorithm"),
        (_meta(lambda m: m.update({PREFIX + "chunk_bytes": "3"})), "not a power of two"),
        (_meta(lambda m: m.update({PREFIX + "chunk_bytes": "+8"})), "not a power of two"),
        (_meta(lambda m: m.update({PREFIX + "chunk_bytes": "0"})), "bad chunk table"),
        (_meta(lambda m: m.update({PREFIX + "chunk_bytes": "4096"})), "chunks for"),
        (
            _meta(lambda m: m.update({PREFIX + "chunks": m[PREFIX + "chunks"][:-1]})),
            "bad chunk table",
        ),
        (
            _meta(lambda m: m.update({PREFIX + "entries": "0" * len(m[PREFIX + "entries"])})),
            "header altered",
        ),
        (
            _meta(lambda m: m.update({PREFIX + "chunks": "f" * len(m[PREFIX + "chunks"])})),
            "checksum mismatch",
        ),
        (
            _meta(lambda m: m.update({"shardstreamX.chunks": m.pop(PREFIX + "chunks")})),
            "damaged checksum metadata",
        ),
    ],
    ids=[
        "no_chunks",
        "no_entries",
        "algorithm",
        "chunk_bytes_3",
        "chunk_bytes_plus",
        "chunk_bytes_0",
        "chunk_bytes_smaller",
        "chunks_cut",
        "entries_zeroed",
        "chunks_replaced",
        "key_renamed",
    ],
)
def test_checksum_metadata_damaged(tmp_path, capsys, change, needle):
    """A file whose checksum keys are partly there, altered or renamed is not read as a
    foreign (unchecked) file."""
    source = _checksummed(tmp_path)
    _edit(source / SINGLE, change)
    _refused(capsys, source, tmp_path, str(source / SINGLE), needle)


# --- config and tokenizer files beside the model ----------------------------------------------


def _set_config(**fields):
    def change(source: Path) -> None:
        config = json.loads((source / "config.json").read_text())
        config.update(fields)
        (source / "config.json").write_text(json.dumps(config))

    return change


def _config_text(text: str):
    return lambda source: (source / "config.json").write_text(text)


def _config_replaced(replace):
    def change(source: Path) -> None:
        (source / "config.json").unlink()
        replace(source / "config.json")

    return change


@pytest.mark.parametrize(
    "change, needles",
    [
        (_config_text("{nope"), ("{config}", "not valid JSON")),
        (_config_text("[1]"), ("{config}", "holds a list")),
        (_config_text('{"model_type": "qwen2", "rope_theta": 1e999}'), ("{config}", "1e999")),
        (_config_replaced(_fifo), ("{config}", "is a FIFO")),
        (_config_replaced(_directory), ("{config}", "is a directory")),
        (_config_replaced(_broken_link), ("{config}", "broken symbolic link")),
        (_set_config(model_type=7), ("{config}", "'model_type' is 7")),
        (_set_config(model_type=["qwen2"]), ("{config}", "'model_type'")),
        (
            _set_config(model_type="qwen2_moe", architectures="Qwen2ForCausalLM"),
            ("{config}", "'architectures'"),
        ),
        (_set_config(model_type="mixtral", architectures=[7]), ("{config}", "'architectures'")),
        (_set_config(torch_dtype="int8"), ("{config}", "'int8' is not a floating dtype")),
        (_set_config(torch_dtype="float128"), ("{config}", "'float128'")),
        (
            _set_config(
                model_type="mixtral",
                architectures=["MixtralForCausalLM"],
                num_hidden_layers=10**15,
                num_local_experts=2,
            ),
            ("{config}", "larger model than the checkpoint"),
        ),
    ],
    ids=[
        "not_json",
        "list",
        "infinity",
        "fifo",
        "directory",
        "broken_link",
        "model_type_int",
        "model_type_list",
        "architectures_string",
        "architectures_int",
        "dtype_int8",
        "dtype_unknown",
        "10**15_layers",
    ],
)
def test_config_beside_the_model_that_is_no_config(tmp_path, capsys, change, needles):
    source = _single(tmp_path / "hf")
    change(source)
    config = str(source / "config.json")
    _refused(capsys, source, tmp_path, *(n.replace("{config}", config) for n in needles))


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_config_or_tokenizer_linked_outside(tmp_path, capsys, name):
    """merge copies these files into its output: one linked to a file elsewhere (a secret)
    would be published with the model."""
    source = _single(tmp_path / "hf")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**CONFIG, "secret": 1}))
    (source / name).unlink(missing_ok=True)
    (source / name).symlink_to(secret)
    _refused(capsys, source, tmp_path, str(source / name), "outside the checkpoint")


# --- targets that are the source ---------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)], ids=["plain", "overwrite"])
@pytest.mark.parametrize("which", ["source", "link_to_source", "parent_of_source"])
def test_target_that_is_or_holds_the_source(tmp_path, capsys, which, overwrite):
    source = _single(tmp_path / "models" / "hf")
    link = tmp_path / "alias"
    link.symlink_to(source)
    target, relation = {
        "source": (source, "is the checkpoint"),
        "link_to_source": (link, "is the checkpoint"),
        "parent_of_source": (source.parent, "contains the checkpoint"),
    }[which]
    _refused(
        capsys, source, tmp_path, f"target {target} {relation}", extra=overwrite, target=target
    )


# --- found by this campaign: each ended in 'no model files found' or an exit 0 -----------------


@pytest.mark.parametrize("replace", [_fifo, _directory, _broken_link], ids=["fifo", "dir", "link"])
@pytest.mark.parametrize("name", [SINGLE, INDEX])
def test_model_file_or_index_that_is_no_regular_file(tmp_path, capsys, name, replace):
    source = _single(tmp_path / "hf") if name == SINGLE else _sharded(tmp_path / "hf")
    (source / name).unlink()
    replace(source / name)
    _refused(capsys, source, tmp_path, str(source / name))


def test_index_that_is_a_fifo_beside_a_single_file(tmp_path, capsys):
    from safetensors.torch import save_file

    source = _sharded(tmp_path / "hf")
    save_file(_state(), str(source / SINGLE))
    (source / INDEX).unlink()
    os.mkfifo(source / INDEX)
    _refused(capsys, source, tmp_path, str(source / INDEX))


@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_tensor_in_a_shard_but_not_in_the_index(tmp_path, capsys, command):
    source = _sharded(tmp_path / "hf")
    left_out = []

    def drop(index: dict) -> None:
        left_out.append(_first_of_second(index))
        del index["weight_map"][left_out[0]]

    _edit_index(source, drop)
    _refused(capsys, source, tmp_path, str(source / SECOND), repr(left_out[0]), command=command)


def test_tensor_in_two_shards_with_different_values(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    source = _sharded(tmp_path / "hf")
    first, second = load_file(str(source / FIRST)), load_file(str(source / SECOND))
    name = min(first)
    second[name] = first[name] + 1
    save_file(second, str(source / SECOND), metadata={"format": "pt"})
    _refused(capsys, source, tmp_path, repr(name))


@pytest.mark.parametrize("replace", [_fifo, _broken_link], ids=["fifo", "broken_link"])
@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_tokenizer_or_generation_config_that_is_no_regular_file(tmp_path, capsys, name, replace):
    source = _single(tmp_path / "hf")
    replace(source / name)
    _refused(capsys, source, tmp_path, str(source / name))


def test_verify_tensor_name_with_a_lone_surrogate(tmp_path, capsys):
    source = _single(tmp_path / "hf")
    header, data = _read(source / SINGLE)
    body = json.dumps(header).encode().replace(b'"model.norm.weight"', b'"model.norm.\\ud800"')
    _write(source / SINGLE, body, data)
    _refused(capsys, source, tmp_path, str(source / SINGLE), command="verify")


@pytest.mark.parametrize("name", [SINGLE, INDEX, FIRST])
def test_weights_file_linked_out_of_the_model(tmp_path, capsys, name):
    """Without config.json nothing looked at the model's links: a weights file (or index)
    linked to a file outside was merged with exit 0."""
    source = _single(tmp_path / "hf") if name == SINGLE else _sharded(tmp_path / "hf")
    (source / "config.json").unlink()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (source / name).rename(outside / name)
    (source / name).symlink_to(outside / name)
    _refused(capsys, source, tmp_path, str(source / name), "outside the checkpoint")


@pytest.mark.parametrize("name", [SINGLE, FIRST])
def test_a_reference_linked_out_of_itself_is_refused_by_test(tmp_path, capsys, name):
    """shardstream test read a reference whose weights file links outside it (merge and
    verify refuse that directory)."""
    checkpoint = _single(tmp_path / "ckpt")
    reference = _single(tmp_path / "ref") if name == SINGLE else _sharded(tmp_path / "ref")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (reference / name).rename(outside / name)
    (reference / name).symlink_to(outside / name)
    code = cli.main(["test", "--local_dir", str(checkpoint), "--test_hf_dir", str(reference)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert f"{reference / name}: symlink points outside the checkpoint" in err


def _hub_snapshot(tmp_path: Path, repo: Path) -> Path:
    """A sharded model as huggingface_hub caches a revision: files in ``repo/blobs``, the
    snapshot directory of links to them."""
    plain = _sharded(tmp_path / "plain")
    (plain / "config.json").write_text(json.dumps(CONFIG))
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(plain.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_huggingface_hub_cache_snapshot_merges(tmp_path):
    """huggingface_hub's cache keeps a revision as links into its repository's blobs/: they
    lead out of the snapshot directory, but not out of the model."""
    from safetensors.torch import load_file

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = _hub_snapshot(tmp_path, repo)
    assert (
        cli.main(["merge", "--local_dir", str(snapshot), "--target_dir", str(tmp_path / "out")])
        == 0
    )
    merged = load_file(str(tmp_path / "out" / SINGLE))
    want = _state()
    assert merged.keys() == want.keys()
    assert all(torch.equal(merged[k], want[k].to(merged[k].dtype)) for k in want)


@pytest.mark.parametrize("target", ["blobs", "repo"])
def test_a_target_holding_what_the_snapshot_links_to_is_refused(tmp_path, capsys, target):
    """--target_dir the cache's blobs/ (or the repository above it) with --overwrite: the
    swap would delete the files the snapshot's links lead to, the model itself."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = _hub_snapshot(tmp_path, repo)
    where = repo / "blobs" if target == "blobs" else repo
    needle = "links to: replacing the target would delete" if target == "blobs" else "contains"
    _refused(capsys, snapshot, tmp_path, needle, extra=("--overwrite",), target=where)


def _not_json(path: Path) -> None:
    path.write_text("{not json")


@pytest.mark.parametrize(
    "replace", [_not_json, _fifo, _directory], ids=["not_json", "fifo", "directory"]
)
def test_verify_reports_a_config_merge_refuses(tmp_path, capsys, replace):
    """verify passed an HF model whose config.json merge and inspect refuse."""
    source = _single(tmp_path / "hf")
    (source / "config.json").unlink()
    replace(source / "config.json")
    _refused(capsys, source, tmp_path, str(source / "config.json"), command="verify")


@pytest.mark.parametrize("command", ["merge", "inspect", "verify"])
def test_index_that_lists_no_tensor(tmp_path, capsys, command):
    """An empty weight_map beside shard files: inspect showed no tensors and verify passed."""
    source = _sharded(tmp_path / "hf")
    _edit_index(source, lambda index: index["weight_map"].clear())
    _refused(capsys, source, tmp_path, str(source / INDEX), "lists no tensor", command=command)


@pytest.mark.parametrize("replace", [_fifo, _broken_link], ids=["fifo", "broken_link"])
def test_verify_reports_a_tokenizer_file_merge_refuses(tmp_path, capsys, replace):
    source = _single(tmp_path / "hf")
    replace(source / "tokenizer.json")
    _refused(capsys, source, tmp_path, str(source / "tokenizer.json"), command="verify")


def test_model_without_config_takes_none_from_the_directory_above(tmp_path, capsys):
    """A model directory with no config.json inside a run directory that has one: merge must
    not take the run's (another model's) config; the output has no config, and says so."""
    run = tmp_path / "run"
    source = _single(run / "exported")
    (source / "config.json").unlink()
    other = {**CONFIG, "model_type": "qwen3_moe", "num_hidden_layers": 7}
    (run / "config.json").write_text(json.dumps(other))
    target = tmp_path / "out"
    assert cli.main(["merge", "--local_dir", str(source), "--target_dir", str(target)]) == 0
    assert not (target / "config.json").exists()
    assert "qwen3_moe" not in capsys.readouterr().out
    with open(target / SINGLE, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        names = set(json.loads(f.read(length))) - {"__metadata__"}
    assert names == set(SHAPES)


@pytest.mark.parametrize("layers", [2, 0], ids=["deeper", "shallower"])
def test_config_of_another_depth_than_the_layers_stored(tmp_path, capsys, layers):
    """config.json's num_hidden_layers must count the layers stored: merge would otherwise
    copy it beside weights its model does not load (random layers, or ignored ones)."""
    source = _single(tmp_path / "model")
    (source / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    needles = (str(source / "config.json"), f"num_hidden_layers is {layers}", "N in 0")
    _refused(capsys, source, tmp_path, *needles)
    _refused(capsys, source, tmp_path, *needles, command="merge", extra=("--keep-names",))
    assert cli.main(["inspect", str(source)]) == 0
    out = capsys.readouterr().out
    assert "merge would refuse" in out and f"num_hidden_layers is {layers}" in out
