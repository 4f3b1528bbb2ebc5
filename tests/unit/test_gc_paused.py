"""Planning runs with Python's cyclic GC paused, on the main thread only."""

from __future__ import annotations

import gc
import threading

import torch

import shardstream
from shardstream.engine.memory import gc_paused
from shardstream.formats import native
from shardstream.training import native_storage


def test_paused_inside_and_restored_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a program that manages the collector itself keeps it off
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_other_threads_leave_the_collector_alone():
    seen = []

    def background():
        with gc_paused():
            seen.append(gc.isenabled())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == [True]


def test_save_and_load_plan_with_the_collector_paused(tmp_path, monkeypatch):
    seen = {}
    write, read = native_storage.StreamingWriter.write_tensors, native.open_native

    def write_tensors(*args, **kwargs):
        seen["save"] = gc.isenabled()
        return write(*args, **kwargs)

    def open_native(*args, **kwargs):
        seen["load"] = gc.isenabled()
        return read(*args, **kwargs)

    monkeypatch.setattr(native_storage.StreamingWriter, "write_tensors", write_tensors)
    monkeypatch.setattr(native, "open_native", open_native)
    model = torch.nn.Linear(4, 3)
    shardstream.save(tmp_path / "step", model=model, contents=("model",))
    fresh = torch.nn.Linear(4, 3)
    shardstream.load(tmp_path / "step", model=fresh, contents=("model",))
    assert seen == {"save": False, "load": False}
    assert gc.isenabled()
    assert torch.equal(fresh.weight, model.weight)
