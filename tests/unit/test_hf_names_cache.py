"""The on-disk cache of the NamePlans transformers computes (``formats/hf_names_cache.py``): a
hit gives the same plan without importing transformers, and a file that is unreadable or does
not fit the request is a miss, never an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardstream.formats import hf_names, hf_names_cache
from shardstream.formats.hf_names import plan_names
from shardstream.storage.commit import TMP_MARK, is_temporary

E, INTER, H = 3, 6, 8
STORED = [
    ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (E, 2 * INTER, H)),
    ("model.layers.0.mlp.experts.down_proj", "BF16", (E, H, INTER)),
    ("model.layers.0.mlp.gate.weight", "BF16", (E, H)),
    ("model.norm.weight", "BF16", (H,)),
]


@pytest.fixture
def config(qwen3_moe_config) -> dict:
    """A tiny Qwen3-MoE config.json's content (tests/unit/conftest.py), E experts of width
    INTER, hidden H."""
    return qwen3_moe_config


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache directory of this test's own, and no in-process memo."""
    path = tmp_path / "layouts"
    monkeypatch.setenv(hf_names_cache.ENV, str(path))
    monkeypatch.setattr(hf_names, "_PLANS", {})
    return path


def _fresh_process(monkeypatch) -> None:
    """What a new process sees: no memo; and tracing would fail, so a plan must be a hit."""
    monkeypatch.setattr(hf_names, "_PLANS", {})

    def no_trace(*_a, **_k):
        raise AssertionError("transformers asked: the cache should have answered")

    monkeypatch.setattr(hf_names, "_trace_v5", no_trace)


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.json"))


def test_a_miss_then_a_hit_gives_the_same_plan(cache, config, monkeypatch):
    first = plan_names(STORED, config)
    assert first.sliced == 9 and "Qwen3MoeForCausalLM" in first.rule
    assert len(_files(cache)) == 1
    assert not [p for p in cache.iterdir() if is_temporary(p.name)]  # renamed into place
    _fresh_process(monkeypatch)
    second = plan_names(STORED, config)
    assert second == first
    assert second.storage() == first.storage()
    assert second.describe() == first.describe()


def test_a_hit_does_not_import_transformers(cache, config, tmp_path):
    plan = plan_names(STORED, config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = f"""
import json, sys
from shardstream.formats.hf_names import plan_names
config = json.load(open({str(tmp_path / "config.json")!r}))
stored = [(n, d, tuple(s)) for n, d, s in json.loads({json.dumps(STORED)!r})]
plan = plan_names(stored, config)
print(json.dumps({{"transformers": "transformers" in sys.modules,
                  "pieces": [[p.name, p.stored, p.start, p.extent] for p in plan.pieces]}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )  # inherits SHARDSTREAM_CACHE_DIR from the monkeypatched environment
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["transformers"] is False
    want = [[p.name, p.stored, list(p.start), list(p.extent)] for p in plan.pieces]
    assert out["pieces"] == want


def _set_first_piece(doc: dict, **fields) -> dict:
    """``doc`` with ``fields`` changed in its first expert's box of ``gate_up_proj``."""
    box = next(p for p in doc["pieces"] if p["stored"] == STORED[0][0])
    assert box["extent"] == [1, INTER, H] and box["shape"] == [INTER, H]
    box.update(fields)
    return doc


TAMPERS = {
    "bad JSON": lambda raw: raw[: len(raw) // 2],
    "not an object": lambda raw: "[1, 2]",
    "Infinity": lambda raw: raw.replace('"storage_numel":', '"storage_numel":Infinity,"x":', 1),
    "huge integer": lambda raw: raw.replace('"storage":', '"storage":' + "9" * 40 + ',"y":', 1),
    "outside its tensor": lambda raw: json.dumps(
        _set_first_piece(json.loads(raw), start=[0, INTER + 1, 0])
    ),
    "unknown tensor": lambda raw: json.dumps(_set_first_piece(json.loads(raw), stored="nope")),
    "shape not the box's": lambda raw: json.dumps(
        _set_first_piece(json.loads(raw), shape=[H, INTER])
    ),
    "duplicate names": lambda raw: json.dumps(
        (lambda d: d["pieces"].append(d["pieces"][0]) or d)(json.loads(raw))
    ),
    "wrong type": lambda raw: json.dumps(_set_first_piece(json.loads(raw), storage="0")),
    "bool for int": lambda raw: json.dumps(_set_first_piece(json.loads(raw), storage=True)),
    "missing field": lambda raw: json.dumps(
        (lambda d: d["pieces"][0].pop("dims") and d)(json.loads(raw))
    ),
    "other format": lambda raw: json.dumps({**json.loads(raw), "format": 999}),
    "other key": lambda raw: json.dumps({**json.loads(raw), "key": "0" * 64}),
    "empty": lambda raw: "",
}


@pytest.mark.parametrize("tamper", TAMPERS)
def test_a_tampered_file_is_ignored_and_rewritten(cache, config, monkeypatch, tamper):
    want = plan_names(STORED, config)
    (path,) = _files(cache)
    path.write_text(TAMPERS[tamper](path.read_text()))
    assert hf_names_cache.load(STORED, config) is None  # a miss, not an error
    monkeypatch.setattr(hf_names, "_PLANS", {})
    assert plan_names(STORED, config) == want  # recomputed by transformers
    assert hf_names_cache.load(STORED, config) is not None  # and the file rewritten
    _fresh_process(monkeypatch)
    assert plan_names(STORED, config) == want


def test_a_directory_in_place_of_the_file_is_a_miss(cache, config, monkeypatch):
    want = plan_names(STORED, config)
    (path,) = _files(cache)
    path.unlink()
    path.mkdir()
    monkeypatch.setattr(hf_names, "_PLANS", {})
    assert plan_names(STORED, config) == want


def test_the_key_changes_with_transformers_config_tensors_and_format(config, monkeypatch):
    key = hf_names_cache.cache_key(STORED, config, "5.25.0")
    assert key == hf_names_cache.cache_key(list(STORED), dict(config), "5.25.0")
    assert key != hf_names_cache.cache_key(STORED, config, "5.25.1")
    assert key != hf_names_cache.cache_key(STORED, {**config, "num_experts_per_tok": 1}, "5.25.0")
    other = {**config, "architectures": ["Qwen3MoeForSequenceClassification"]}
    assert key != hf_names_cache.cache_key(STORED, other, "5.25.0")
    assert key != hf_names_cache.cache_key(STORED, {**config, "model_type": "x"}, "5.25.0")
    assert key != hf_names_cache.cache_key([(n, "F32", s) for n, _, s in STORED], config, "5.25.0")
    assert key != hf_names_cache.cache_key(STORED[:-1], config, "5.25.0")
    assert key != hf_names_cache.cache_key(list(reversed(STORED)), config, "5.25.0")
    # a tensor config.json ties is keyed apart from the stored ones
    assert key != hf_names_cache.cache_key(STORED[:-1], config, "5.25.0", tied=STORED[-1:])
    # the installed version is read from package metadata, which imports nothing
    from importlib.metadata import version

    assert hf_names_cache.cache_key(STORED, config) == hf_names_cache.cache_key(
        STORED, config, version("transformers")
    )
    # the planning code's version: CACHE_FORMAT, bumped when what plan_names computes changes
    monkeypatch.setattr(hf_names_cache, "CACHE_FORMAT", hf_names_cache.CACHE_FORMAT + 1)
    assert key != hf_names_cache.cache_key(STORED, config, "5.25.0")


def _fake_plans(directory: Path, count: int, first_mtime: int = 1_000_000) -> list[Path]:
    """``count`` files named as plans, the first the oldest (mtimes ``first_mtime`` on)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{i:064x}.json" for i in range(count)]
    for age, path in enumerate(paths):
        path.write_text("{}")
        os.utime(path, (first_mtime + age, first_mtime + age))
    return paths


def test_a_store_keeps_the_most_recently_used_plans(cache, config, monkeypatch):
    """At most MAX_ENTRIES plans: a hit touches its file, a store removes the least recently
    used beyond the bound, and files not named as plans stay."""
    monkeypatch.setattr(hf_names_cache, "MAX_ENTRIES", 4)
    plan = plan_names(STORED, config)
    (ours,) = _files(cache)
    old = _fake_plans(cache, 6)
    os.utime(ours, (500, 500))  # the least recently used of all...
    stray = cache / "notes.json"
    stray.write_text("{}")
    _fresh_process(monkeypatch)
    assert plan_names(STORED, config) == plan  # ...until a hit touches it
    assert ours.stat().st_mtime > old[-1].stat().st_mtime
    hf_names_cache.store(STORED[:-1], config, plan.rule, plan.pieces)  # another request
    new = cache / f"{hf_names_cache.cache_key(STORED[:-1], config)}.json"
    assert set(_files(cache)) == {new, ours, old[-1], old[-2], stray}
    _fresh_process(monkeypatch)
    assert plan_names(STORED, config) == plan  # still a hit


def test_the_default_bound_is_64_plans(cache, config):
    assert hf_names_cache.MAX_ENTRIES == 64
    old = _fake_plans(cache, 70)
    plan = plan_names(STORED, config)
    ours = cache / f"{hf_names_cache.cache_key(STORED, config)}.json"
    assert set(_files(cache)) == {ours, *old[-63:]}
    assert plan.sliced == 9


def test_pruning_tolerates_other_processes(tmp_path, monkeypatch):
    """Files another process removed first (between the listing and the removal), and a
    directory removed altogether: no error, the rest pruned."""
    paths = _fake_plans(tmp_path / "layouts", 5)
    unlink = os.unlink

    def raced(path, *args, **kwargs):
        unlink(path, *args, **kwargs)  # the other process
        unlink(path, *args, **kwargs)  # ours: FileNotFoundError

    with monkeypatch.context() as patch:
        patch.setattr(os, "unlink", raced)
        hf_names_cache.prune(tmp_path / "layouts", 2)
    assert _files(tmp_path / "layouts") == paths[-2:]
    hf_names_cache.prune(tmp_path / "gone", 2)


def test_pruning_removes_what_crashed_writes_left_once_an_hour_old(tmp_path):
    """A plan file's temporary (``atomic_write_bytes``: name, TMP_MARK, 8 hex digits) is a
    write a crash cut off once it is an hour old, and goes; a younger one may be another
    process's write in progress, and other names are not the cache's: both stay."""
    directory = tmp_path / "layouts"
    (plan,) = _fake_plans(directory, 1)
    stale = directory / f"{plan.name}{TMP_MARK}0123abcd"
    young = directory / f"{plan.name}{TMP_MARK}89abcdef"
    foreign = directory / f"notes.json{TMP_MARK}0123abcd"
    for path in (stale, young, foreign):
        path.write_bytes(b"{")
    hour_ago = time.time() - hf_names_cache.STALE_WRITE_S - 60
    for path in (stale, foreign):
        os.utime(path, (hour_ago, hour_ago))
    hf_names_cache.prune(directory)
    assert set(directory.iterdir()) == {plan, young, foreign}


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.setenv(hf_names_cache.ENV, str(tmp_path / "x"))
    assert hf_names_cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(hf_names_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_names_cache.cache_dir() == tmp_path / "xdg" / "shardstream" / "hf-layouts"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_names_cache.cache_dir() == tmp_path / "home" / ".cache" / "shardstream" / "hf-layouts"


def test_an_empty_cache_dir_setting_disables_the_cache(config, monkeypatch, tmp_path):
    monkeypatch.setenv(hf_names_cache.ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(hf_names, "_PLANS", {})
    assert hf_names_cache.cache_dir() is None
    plan = plan_names(STORED, config)
    assert plan.sliced == 9
    assert not list(tmp_path.rglob("*.json"))
    assert hf_names_cache.load(STORED, config) is None


def test_an_unwritable_cache_dir_still_plans(config, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # a path under a regular file: mkdir fails even for root (unlike permission bits)
    monkeypatch.setenv(hf_names_cache.ENV, str(blocker / "layouts"))
    monkeypatch.setattr(hf_names, "_PLANS", {})
    with caplog.at_level("DEBUG", logger=hf_names_cache.__name__):
        plan = plan_names(STORED, config)
    assert plan.sliced == 9
    assert "not caching the layout" in caplog.text


def test_only_plans_transformers_computed_are_cached(cache, config):
    plan_names([("_orig_mod.model.norm.weight", "F32", (4,))], {"model_type": "qwen2"})
    plan_names([("x", "F32", (2,))], {})
    plan_names(STORED, config, keep_names=True)
    assert not cache.exists() or not _files(cache)


def test_the_test_session_never_uses_the_home_cache():
    import os

    path = Path(os.environ[hf_names_cache.ENV])
    assert path.name.startswith("shardstream-test-cache-")
    assert hf_names_cache.cache_dir() == path


BIGBIRD = {  # config.json ties the head (its default); BigBirdPegasusForCausalLM ties none
    "model_type": "bigbird_pegasus",
    "architectures": ["BigBirdPegasusForCausalLM"],
    "vocab_size": 64, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32, "max_position_embeddings": 64, "attention_type": "original_full",
}  # fmt: skip


def test_a_tied_head_the_model_holds_apart_is_planned_from_the_cache_too(cache, monkeypatch):
    """config.json ties the head, the class does not: the head is written, and the cached
    plan says so without transformers."""
    transformers = pytest.importorskip("transformers")
    import torch

    with torch.device("meta"):
        model = transformers.BigBirdPegasusForCausalLM(transformers.BigBirdPegasusConfig(**{
            k: v for k, v in BIGBIRD.items() if k not in ("model_type", "architectures")
        }))  # fmt: skip
    held = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    stored = [(n, "F32", tuple(p.shape)) for n, p in model.state_dict().items()]
    head = [t for t in stored if t[0] == "lm_head.weight"]
    rest = [t for t in stored if t[0] != "lm_head.weight"]
    first = plan_names(rest, BIGBIRD, tied=head)
    assert first.untied == (() if held else ("lm_head.weight",))
    assert ("lm_head.weight" in {p.name for p in first.pieces}) is not held
    _fresh_process(monkeypatch)
    assert plan_names(rest, BIGBIRD, tied=head) == first


def test_a_tied_head_the_model_ties_stays_left_out(cache, config):
    vocab = config["vocab_size"]
    head = [("lm_head.weight", "BF16", (vocab, H))]
    stored = [*STORED, ("model.embed_tokens.weight", "BF16", (vocab, H))]
    plan = plan_names(stored, {**config, "tie_word_embeddings": True}, tied=head)
    assert plan.untied == () and "lm_head.weight" not in {p.name for p in plan.pieces}
