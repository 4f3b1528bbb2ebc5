"""A stand-in for huggingface_hub's ``HfApi`` that records what it is asked (tests reach no
network)."""

from __future__ import annotations

from pathlib import Path


class RecordingHub:
    """What ``HfApi`` is asked, and the merged folder as it was when uploaded."""

    def __init__(self, fail: Exception | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail
        self.uploaded: dict[str, bytes] = {}

    def __call__(self):  # stands for the HfApi class
        return self

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))
        if self.fail is not None:
            raise self.fail
        return f"https://huggingface.co/{kwargs['repo_id']}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        folder = Path(kwargs["folder_path"])
        self.uploaded = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")}
        return f"https://huggingface.co/{kwargs['repo_id']}/commit/0123abcd"
