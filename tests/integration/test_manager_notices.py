"""What the manager says when it does something a user may not expect, and how it names what
it refuses: a restore falling back past step directories that were never committed, ranks the
save did not have taking rank 0's extra state, another optimizer, a head tied on one side only,
a save below newer committed steps."""

from __future__ import annotations

import logging

import pytest
import torch

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.errors import CheckpointFormatError
from shardstream.formats import native
from shardstream.storage.run_layout import write_latest
from shardstream.training import load as loading


def _manager(root) -> CheckpointManager:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return CheckpointManager(CheckpointConfig(str(root)), model=model, optimizer=optimizer)


def test_a_newer_step_directory_without_a_manifest_is_named(tmp_path, caplog):
    """The pointer named step 4, whose directory holds no manifest: restore took step 2
    without a word."""
    with _manager(tmp_path / "run") as manager:
        manager.save(1)
        manager.save(2)
    (tmp_path / "run" / "global_step_4").mkdir()
    write_latest(tmp_path / "run", 4)
    with _manager(tmp_path / "run") as manager, caplog.at_level(logging.WARNING, "shardstream"):
        assert manager.restore()[0] == 2
    assert "global_step_4 not committed (no manifest.json): restoring step 2" in caplog.text


def test_steps_committed_or_removed_after_the_listing_are_not_called_uncommitted(tmp_path, caplog):
    """A run saving beside a restore commits newer steps and renames old ones away after the
    restore listed the steps: the restore warned "global_step_N not committed" of a step that
    was committed (the pointer, or a directory, newer than the one it picked) or deleted."""
    with _manager(tmp_path / "run") as manager:
        manager.save(1)
        manager.save(2)
    with _manager(tmp_path / "run") as manager, caplog.at_level(logging.WARNING, "shardstream"):
        manager._say_skipped_above(1)  # step 1 listed; step 2 committed meanwhile
        write_latest(tmp_path / "run", 3)  # step 3 committed, then renamed away by retention
        manager._say_skipped_above(1)
    assert "not committed" not in caplog.text, caplog.text


def test_a_restore_of_the_newest_committed_step_is_quiet(tmp_path, caplog):
    with _manager(tmp_path / "run") as manager:
        manager.save(1)
    with _manager(tmp_path / "run") as manager, caplog.at_level(logging.WARNING, "shardstream"):
        assert manager.restore()[0] == 1
    assert "not committed" not in caplog.text


def test_ranks_the_save_did_not_have_are_told_they_share_rank_0s_state(tmp_path, caplog):
    """Restored at more ranks than saved, ranks 1.. took rank 0's extra state and RNG
    streams silently (documented in format.md; now said once, by the first such rank)."""
    with _manager(tmp_path / "run") as manager:
        manager.save(1, extra={"epoch": 3})
    ckpt = native.open_native(tmp_path / "run" / "global_step_1")
    with caplog.at_level(logging.WARNING, "shardstream"):
        assert loading._read_extra(ckpt, 1)["user"] == {"epoch": 3}
        assert loading._read_extra(ckpt, 2)["user"] == {"epoch": 3}
    assert caplog.text.count("saved at world size 1; ranks from 1 on restore rank 0's") == 1


def _qwen2(tie: bool):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def _saved_adamw(root):
    model = _qwen2(tie=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    with CheckpointManager(CheckpointConfig(str(root)), model=model, optimizer=optimizer) as m:
        m.save(1)


def test_another_optimizer_is_named_as_such(tmp_path):
    """An AdamW checkpoint restored into SGD with momentum asked "was it saved from a
    different model?"."""
    _saved_adamw(tmp_path / "run")
    model = _qwen2(tie=False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = CheckpointConfig(str(tmp_path / "run"))
    with CheckpointManager(config, model=model, optimizer=sgd) as m:
        with pytest.raises(CheckpointFormatError) as exc:
            m.restore()
    text = str(exc.value)
    assert "the live optimizer keeps momentum_buffer, the checkpoint exp_avg, exp_avg_sq" in text
    assert "different model" not in text


def test_a_head_tied_on_one_side_only_is_named_as_such(tmp_path):
    _saved_adamw(tmp_path / "run")
    model = _qwen2(tie=True)
    optimizer = torch.optim.AdamW(model.parameters())
    config = CheckpointConfig(str(tmp_path / "run"))
    with CheckpointManager(config, model=model, optimizer=optimizer) as m:
        with pytest.raises(CheckpointFormatError, match="untied output head, restored into a "):
            m.restore()


def test_saving_below_newer_committed_steps_says_so(tmp_path, caplog):
    """After a rollback (restore an older step, train, save), the newer steps stayed beside
    the new one, uncounted by keep_last, without a word."""
    with _manager(tmp_path / "run") as manager:
        manager.save(2)
        manager.save(4)
        with caplog.at_level(logging.WARNING, "shardstream"):
            manager.save(3)
        assert manager.all_steps() == [2, 3, 4] and manager.latest_step() == 3
    assert "saving step 3 while newer steps are committed (4)" in caplog.text
