"""Test-only import stubs for ``torchvision`` and ``vllm``, which SGLang imports on CPU but which
must never be installed here (each pulls a multi-GB CUDA torch).

Two uses:
* the live-server test puts this folder on ``PYTHONPATH`` after tracediff's shim, whose
  ``sitecustomize`` chains to this one in every process SGLang starts;
* in-process tests call :func:`install` (loaded by file path, not as ``sitecustomize``).

The stubs are permissive: any attribute is a dummy class that can be called, subclassed and
indexed; ``__version__`` parses as a version. Nothing here is part of the tracediff package.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision", "vllm")
_VERSION = "0.0.0.dev0+tracediffstub"


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Any

    def __getitem__(cls, item):
        return _Any

    def __or__(cls, other):
        return _Any

    __ror__ = __or__


class _Any(metaclass=_AnyMeta):
    """Stands for any object of a stubbed package."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Any

    def __call__(self, *args, **kwargs):
        return _Any()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Any


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = _VERSION
        return module

    def exec_module(self, module):
        pass


_FINDER = _StubFinder()


def install():
    """Put the finder last on ``sys.meta_path`` (once): a real installed package still wins."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_FINDER)


install()
