"""jaxkv: long-context sparse-attention decoding in JAX/Pallas with the KV cache in host RAM.

Main entry points: :func:`jaxkv.load` (a model with its tokenizer) and :func:`jaxkv.generate`
(text, chats or token ids in; text and tokens out; kept contexts). Configuration: :class:`CacheConfig` (static) and
:class:`Sampling` (traced). Lower level: :mod:`jaxkv.cache` (host-tier state),
:mod:`jaxkv.lru` (static-shape LRU), :mod:`jaxkv.engine` (compiled prefill/decode),
:mod:`jaxkv.kernels` (Pallas kernels with their jnp references), :mod:`jaxkv.models`
(functional models, loaders, tokenizers).
"""
import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys


class _SourceTree(_abc.MetaPathFinder):
    """Source checkout run without an install (``PYTHONPATH=<repo>``): the repository's
    top-level ``models/`` and ``pallas_kernels/`` serve as ``jaxkv.models`` and
    ``jaxkv.kernels``, as pyproject's package-dir maps them in an install. Consulted first,
    so that the folders next to the imported ``jaxkv`` win over an editable install of
    another checkout (git worktrees)."""

    def __init__(self, folders: dict):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return _util.spec_from_file_location(fullname, _os.path.join(folder, "__init__.py"),
                                             submodule_search_locations=[folder])


def _map_source_tree():
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not _os.path.isfile(_os.path.join(root, "pyproject.toml")):
        return  # an installed distribution: jaxkv/models and jaxkv/kernels are real folders
    folders = {f"{__name__}.{name}": _os.path.join(root, folder)
               for name, folder in (("models", "models"), ("kernels", "pallas_kernels"))
               if _os.path.isfile(_os.path.join(root, folder, "__init__.py"))}
    if folders and not any(isinstance(f, _SourceTree) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _SourceTree(folders))


_map_source_tree()

from jaxkv.config import CacheConfig, Sampling, Tuning, greedy
from jaxkv.spec import INVALID, CacheSpec
from jaxkv.validation import StrictModeError

__all__ = ["CacheConfig", "CacheSpec", "Context", "GenerateResult", "INVALID", "Model", "Sampling",
           "StrictModeError", "Tuning", "generate", "greedy", "load"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing jaxkv must not pull the kernels and models
    if name in ("generate", "GenerateResult", "TokenStream"):
        from jaxkv import api as _g
        return getattr(_g, name)
    if name in ("load", "Model"):
        from jaxkv import text as _t
        return getattr(_t, name)
    if name == "Context":
        from jaxkv import context as _c
        return _c.Context
    if name in ("models", "kernels"):  # subpackages: ``jaxkv.models.load`` after ``import jaxkv``
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
