"""A run directory's names: one spelling of ``global_step_N``, the latest pointer, debris."""

from __future__ import annotations

from shardstream.storage.run_layout import (
    LATEST_FILE,
    committed_steps,
    is_run_entry,
    read_latest,
    step_dirs,
    step_in_path,
    step_name,
    step_of,
    write_latest,
)


def test_step_names_round_trip():
    assert step_name(7) == "global_step_7" and step_of("global_step_7") == 7
    assert step_of("global_step_0") == 0
    # one spelling per step: no leading zero, ASCII digits only (int() reads "\uff11" as 1)
    names = ("global_step_", "global_step_7.tmp-0123abcd", "global_step_x", "step_7")
    for other in (*names, "global_step_07", "global_step_\uff11", "global_step_\u0661"):
        assert step_of(other) is None, other
    assert step_in_path("/ckpt/global_step_\uff11/actor") is None


def test_other_tools_step_and_file_names_take_ascii_digits_only():
    from shardstream.formats.dcp import step_of_name
    from shardstream.formats.source import TRAINER_CHECKPOINT, VERL_MODEL_FILE

    assert step_of_name("checkpoint-12") == 12 and step_of_name("checkpoint-\uff11\uff12") is None
    assert TRAINER_CHECKPOINT.fullmatch("checkpoint-3")
    assert not TRAINER_CHECKPOINT.fullmatch("checkpoint-\uff13")
    assert VERL_MODEL_FILE.match("model_world_size_2_rank_1.pt")
    assert not VERL_MODEL_FILE.match("model_world_size_2_rank_\uff11.pt")


def test_step_in_path_finds_the_enclosing_step():
    assert step_in_path("/ckpt/global_step_40/actor") == 40
    assert step_in_path("/ckpt/actor") is None


def test_committed_steps_need_a_manifest(tmp_path):
    for step in (3, 10, 2):
        (tmp_path / step_name(step)).mkdir()
    (tmp_path / "global_step_3" / "manifest.json").write_text("{}")
    (tmp_path / "global_step_10" / "manifest.json").write_text("{}")
    (tmp_path / "global_step_4.tmp-0123abcd").mkdir()
    assert committed_steps(tmp_path) == [3, 10]
    assert sorted(step_dirs(tmp_path)) == [2, 3, 10]
    assert committed_steps(tmp_path / "missing") == []


def test_latest_pointer(tmp_path):
    assert read_latest(tmp_path) is None
    write_latest(tmp_path, 12)
    assert (tmp_path / LATEST_FILE).read_text() == "12" and read_latest(tmp_path) == 12  # as verl
    (tmp_path / LATEST_FILE).write_text("twelve")
    assert read_latest(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir()] == [LATEST_FILE]


def test_run_entries():
    assert is_run_entry("global_step_3") and is_run_entry(LATEST_FILE)
    assert not is_run_entry("notes") and not is_run_entry("global_step_3.tmp-0123abcd")
