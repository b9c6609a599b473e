"""Put on ``PYTHONPATH`` of a vLLM process that serves a vision model on the CPU build.

vLLM 0.32 reads every vision encoder's sizes through a module that imports transformers'
Pixtral image processor, and that module imports torchvision at the top; a SigLIP model never
calls it. PyPI's torchvision wheels are CUDA builds that break ``import vllm`` on a CPU host
(the Makefile uninstalls them). This makes ``import torchvision`` (and any submodule) give
empty modules whose names are inert placeholders, while ``importlib.util.find_spec`` still
says torchvision is not installed, so transformers keeps to its PIL image processors. Nothing
of it runs: a model that did call torchvision would fail at once."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_PACKAGE = "torchvision"
_find_spec = importlib.util.find_spec


def _ours(name: str) -> bool:
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def _find_spec_without_torchvision(name: str, package: str | None = None) -> Any:
    return None if _ours(name) else _find_spec(name, package)


class _Placeholder:
    """Any name taken from the stand-in: callable, subclassable, never used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def _placeholder(name: str) -> _Placeholder:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _ours(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _placeholder  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


importlib.util.find_spec = _find_spec_without_torchvision
sys.meta_path.insert(0, _StandIn())
