"""Device-to-host copies through a bounded ring of (pinned) host buffers."""

from __future__ import annotations

import os

import numpy as np
import torch


class HostTransfer:
    """Device-to-host copies through a bounded ring of (pinned) host buffers.

    Slot ``i + 1`` is filled on a side stream while slot ``i`` is copied out, so transfers
    overlap; the ring bounds host memory at ``slots * slot_bytes``. With ``stagger_path``,
    ranks on one host take turns (an flock per slot), so they don't saturate the host link
    together. CPU tensors run the same logic without streams, which is how it is tested.
    """

    def __init__(self, slot_bytes: int = 8 << 20, slots: int = 3, stagger_path: str | None = None):
        self.slot_bytes, self.count = slot_bytes, slots
        self.stagger_path = stagger_path
        self.slots: list[torch.Tensor] = []
        self.stream = None
        self.transfers = 0

    def _ensure(self, device: torch.device) -> None:
        if self.slots:
            return
        pinned = device.type == "cuda" and torch.cuda.is_available()
        self.slots = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=pinned)
            for _ in range(self.count)
        ]
        if pinned:
            self.stream = torch.cuda.Stream(device=device)

    def copy_to_host(self, src: torch.Tensor, out: np.ndarray) -> None:
        self._ensure(src.device)
        total = out.nbytes
        pending: list[tuple[int, int, torch.Tensor, object]] = []
        position = 0
        index = 0
        while position < total or pending:
            # Keep up to ``count - 1`` copies in flight ahead of the one being drained.
            while position < total and (len(pending) < self.count - 1 or not pending):
                n = min(self.slot_bytes, total - position)
                slot = self.slots[index % self.count]
                index += 1
                event = self._issue(slot[:n], src[position : position + n])
                pending.append((position, n, slot, event))
                position += n
            start, n, slot, event = pending.pop(0)
            if event is not None:
                event.synchronize()
            out[start : start + n] = slot[:n].numpy()

    def _issue(self, slot: torch.Tensor, src: torch.Tensor):
        self.transfers += 1
        with self._turn():
            if self.stream is None:
                slot.copy_(src)
                return None
            with torch.cuda.stream(self.stream):
                slot.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            return event

    def _turn(self):
        import contextlib

        if self.stagger_path is None:
            return contextlib.nullcontext()
        from ..storage import locks

        return locks.held(self.stagger_path)  # one turn at a time among this host's processes


_DEFAULT_TRANSFER: HostTransfer | None = None


def default_transfer() -> HostTransfer:
    global _DEFAULT_TRANSFER
    if _DEFAULT_TRANSFER is None:
        _DEFAULT_TRANSFER = HostTransfer()
    return _DEFAULT_TRANSFER


def configure_host_transfers(stagger: bool, slot_bytes: int = 8 << 20, slots: int = 3) -> None:
    """Set how device tensors reach the host (``stagger_host_transfers`` in the config)."""
    import tempfile

    global _DEFAULT_TRANSFER
    path = None
    if stagger:
        job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "local"
        path = os.path.join(tempfile.gettempdir(), f"shardstream-d2h-{job}.lock")
    _DEFAULT_TRANSFER = HostTransfer(slot_bytes, slots, path)
