"""``merge --hf_upload_path REPO``: the merged directory published to a Hugging Face Hub
repository, as verl's merger does it (the repository created if missing, ``--private`` if
asked, then the folder uploaded). huggingface_hub is needed only here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import ShardstreamError, UsageError


def check_upload(repo_id: str) -> None:
    """Before anything is merged: huggingface_hub is installed and ``repo_id`` is a valid
    repository id, so a long merge does not end in an error that was known at the start."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise UsageError(
            "--hf_upload_path needs huggingface_hub: pip install huggingface_hub "
            "(or shardstream[hub])"
        )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except ValueError as exc:
        raise UsageError(f"--hf_upload_path {repo_id!r}: {_one_line(exc)}") from None


def upload_to_hub(directory: str | os.PathLike, repo_id: str, private: bool = False) -> str:
    """Upload the merged ``directory`` to the model repository ``repo_id``; returns what the
    Hub says of the commit (its URL). A failure (no token, no network, no permission) is one
    line naming the repository; the merged directory stays as it is."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    api = HfApi()
    try:
        api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(folder_path=str(directory), repo_id=repo_id, repo_type="model")
    except Exception as exc:  # noqa: BLE001 - HTTP, network, auth: reported as one line
        raise ShardstreamError(
            f"merged into {directory}, but uploading it to {repo_id} failed "
            f"({type(exc).__name__}: {_one_line(exc)}); the merged directory is complete: "
            f"upload it with `hf upload{' --private' if private else ''} {repo_id} {directory}`"
        ) from None
    return str(getattr(commit, "commit_url", None) or commit)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
