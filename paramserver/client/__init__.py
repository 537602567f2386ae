"""The one client stack: channels, cluster view, model references, the chunk-fetch engine,
pull and push, and the ``paramctl`` CLI.

The public Python API (docs/python-api.md)::

    from paramserver.client import push, pull, ClusterClient

Every entry point takes the cluster, tokens, TLS and verify mode from the same settings as the
CLIs (``paramserver.client.config``): arguments > environment > ``PARAMS_CONFIG`` file > defaults.

These names are imported on first use (module ``__getattr__``), so ``import paramserver.client``
(and a light submodule such as ``refs`` or ``config``'s users) does not import torch or gRPC.
``push`` and ``pull`` are also the names of the submodules that define them: this package keeps
the functions under those names even after the submodules are imported (see ``_Package``); the
modules themselves are reached as ``from paramserver.client.push import PushOptions``.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramserver.client.pull import pull as pull
    from paramserver.client.push import push as push
    from paramserver.client.session import ClusterClient as ClusterClient

# public name -> the module that defines it
_LAZY = {"push": "paramserver.client.push", "pull": "paramserver.client.pull", "ClusterClient": "paramserver.client.session"}

__all__ = ["ClusterClient", "pull", "push"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # after the import, which bound the submodule under the same name
    return value


class _Package(types.ModuleType):
    """This package, refusing to let an import of its ``push`` / ``pull`` submodule rebind the
    package's ``push`` / ``pull`` to the module (the import system binds every submodule on its
    parent): ``from paramserver.client import push`` must give the function, whichever module
    imported ``paramserver.client.push`` first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == value.__name__:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
