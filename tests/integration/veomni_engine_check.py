"""Run as a script by test_verl_plugin.py: import verl's VeOmni engine module with the plug-in
on, where the ``veomni`` package is not installable (veomni 0.1.12 does not import beside
transformers 5). A finder answers every ``veomni.*`` import with an empty module whose names
are placeholders, so that verl's own module file runs its imports; nothing of verl is
replaced. Prints which class the engine module then builds."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Placeholder,), {})


class _VeOmniStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "veomni" or fullname.startswith("veomni."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if __name__ == "__main__":
    os.environ["SHARDSTREAM_VERL"] = "1"
    sys.meta_path.append(_VeOmniStubs())
    import verl  # noqa: F401  (loads the plug-in)
    from verl.workers.engine.veomni import transformer_impl

    built = transformer_impl.FSDPCheckpointManager
    print(f"{built.__module__}.{built.__qualname__}")
