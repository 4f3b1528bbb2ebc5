"""verl's model merger classes, answered by shardstream's streaming merge.

A script that drives verl's merger from Python (``verl.model_merger``, 0.9.1)::

    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=actor,
                               target_dir=out, hf_model_config_path=f"{actor}/huggingface")
    merger = FSDPModelMerger(config)
    merger.merge_and_save()
    merger.cleanup()

runs unchanged with ``from shardstream.integrations.verl_merger import FSDPModelMerger,
ModelMergerConfig``: the same fields, defaults and calls, and the files ``shardstream merge``
writes for the same flags, in memory bounded by the copy buffer instead of the whole model.
Nothing here imports verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ReferenceMismatchError, UsageError

if TYPE_CHECKING:
    from ..commands.merge import MergeSummary
    from ..commands.test import CompareReport

OPERATIONS = ("merge", "test")


@dataclass
class ModelMergerConfig:
    """verl's ``ModelMergerConfig``: its fields in its order with its defaults. Ours, last:
    ``overwrite`` replaces a non-empty ``target_dir`` whole once the new merge is complete;
    without it the merge is written into it as verl's merger does (its other files stay);
    ``dtype`` is what the tensors are written as: bfloat16, as verl's merger always writes
    (None: what ``shardstream merge`` without ``--dtype`` writes, bfloat16 for verl's
    checkpoints too)."""

    operation: str  # "merge" or "test"
    backend: str
    target_dir: str | None = "tmp"
    hf_upload_path: str | None = None
    private: bool = False
    test_hf_dir: str | None = None
    tie_word_embedding: bool = False
    trust_remote_code: bool = False  # accepted: no model code is loaded
    is_value_model: bool = False  # accepted: the value head is a tensor like any other
    local_dir: str | None = None
    hf_model_config_path: str | None = None
    hf_upload: bool = field(init=False)
    use_cpu_initialization: bool = False  # accepted: no model is built
    overwrite: bool = False
    dtype: str | None = "bfloat16"

    def __post_init__(self) -> None:
        self.hf_upload = self.operation == "merge" and bool(self.hf_upload_path)
        if self.operation == "test":
            self.target_dir = None
            self.hf_upload_path = None
            self.private = False


class FSDPModelMerger:
    """verl's ``FSDPModelMerger(config)``: ``merge_and_save()`` merges (or, for operation
    "test", compares with ``test_hf_dir``), ``upload_to_huggingface()`` publishes the merged
    directory, ``cleanup()`` has nothing to remove. Arguments are checked here, before any
    work, as verl's constructor fails early on a missing config."""

    def __init__(self, config: ModelMergerConfig):
        if config.backend != "fsdp":
            raise UsageError(
                f"backend {config.backend!r} is not supported; shardstream merges FSDP "
                "checkpoints (backend='fsdp')"
            )
        if config.operation not in OPERATIONS:
            raise UsageError(f"operation {config.operation!r}: expected 'merge' or 'test'")
        if not config.local_dir:
            raise UsageError("local_dir is not set: the checkpoint directory to merge")
        if config.operation == "test" and not config.test_hf_dir:
            raise UsageError("test_hf_dir must be set for operation 'test'")
        if config.operation == "merge" and not config.target_dir:
            raise UsageError("target_dir is not set: where the merged model goes")
        config_path = config.hf_model_config_path
        if config_path and not Path(config_path, "config.json").is_file():
            raise UsageError(f"hf_model_config_path {config_path}: no config.json there")
        if config.hf_upload:
            from ..commands.upload import check_upload

            check_upload(config.hf_upload_path)
        self.config = config
        self.hf_model_config_path = config.hf_model_config_path

    def merge_and_save(self) -> MergeSummary | CompareReport:
        """Merge ``local_dir`` into ``target_dir`` (then upload it when ``hf_upload_path`` is
        set), or compare it with ``test_hf_dir``: a mismatch raises ReferenceMismatchError (an
        AssertionError, as verl's check raises) naming the first differing tensors and how
        many more differ."""
        if self.config.operation == "test":
            return self._test()
        summary = self._merge()
        if self.config.hf_upload:
            self.upload_to_huggingface()
        return summary

    def upload_to_huggingface(self) -> str:
        """Upload ``target_dir`` to ``hf_upload_path`` (created if missing, ``private`` if
        asked); returns the commit's URL."""
        from ..commands.upload import check_upload, upload_to_hub

        if not self.config.hf_upload_path:
            raise UsageError("hf_upload_path is not set: the Hub repository to upload to")
        check_upload(self.config.hf_upload_path)
        return upload_to_hub(
            self.config.target_dir, self.config.hf_upload_path, self.config.private
        )

    def cleanup(self) -> None:
        """Nothing to remove: the merge leaves no temporary files behind."""

    def _merge(self) -> MergeSummary:
        from ..commands.merge import merge

        config = self.config
        return merge(
            config.local_dir,
            config.target_dir,
            dtype=config.dtype,
            overwrite=config.overwrite,
            update=True,
            hf_model_path=self.hf_model_config_path,
            tie_word_embedding=config.tie_word_embedding,
        )

    def _test(self) -> CompareReport:
        from ..commands.test import compare_with_reference

        config = self.config
        report = compare_with_reference(
            config.local_dir,
            config.test_hf_dir,
            dtype=config.dtype,
            hf_model_path=self.hf_model_config_path,
            tie_word_embedding=config.tie_word_embedding,
        )
        if not report.ok:
            shown = "; ".join(report.problems[:5])
            more = len(report.problems) - 5
            raise ReferenceMismatchError(
                f"{config.local_dir} differs from {config.test_hf_dir}: {shown}"
                + (f" (and {more} more)" if more > 0 else "")
            )
        return report
