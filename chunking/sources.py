"""Read a model's weights from a state dict, a .safetensors file or a torch file."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import torch

from chunking.errors import InvalidInput

Source = Union[Mapping[str, torch.Tensor], str, "os.PathLike[str]"]
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def load_source(source: Source) -> dict[str, torch.Tensor]:
    """A ``{name: tensor}`` dict from a state dict or a weights file path."""
    if isinstance(source, Mapping):
        return _checked(source, "the state dict")
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidInput(f"cannot read weights from a {type(source).__name__}: pass a state dict or a file path")
    path = Path(source)
    if not path.is_file():
        raise InvalidInput(f"weights file {path} does not exist")
    if not os.access(path, os.R_OK):
        raise InvalidInput(f"weights file {path} cannot be read: permission denied; check its owner and mode")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return _checked(load_file(str(path), device="cpu"), str(path))
        except InvalidInput:
            raise
        except Exception as exc:  # safetensors raises its own untyped errors
            raise InvalidInput(f"{path} is not a readable safetensors file: {exc}") from exc
    if path.suffix in TORCH_SUFFIXES:
        return _checked(_torch_load(path), str(path))
    raise InvalidInput(f"unknown weights file type {path.suffix!r}: use .safetensors, {', '.join(TORCH_SUFFIXES)}")


def _torch_load(path: Path) -> Any:
    try:
        # mmap avoids holding the file in memory twice; legacy (non-zip) files cannot be mapped.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        pass
    except Exception as exc:
        raise _unloadable(path, exc) from exc
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _unloadable(path, exc) from exc


def _unloadable(path: Path, exc: Exception) -> InvalidInput:
    # torch's own message suggests weights_only=False, which would run arbitrary pickled code: not here.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "weights_only" in first or "weights only" in first.lower():  # torch's advice to load it unrestricted: never here
        first = "it holds objects other than tensors"
    return InvalidInput(
        f"{path} cannot be read as a weights-only torch file ({first[:200]}). Only tensors are accepted, never "
        "other pickled objects: save it with torch.save(model.state_dict(), path) or as .safetensors"
    )


def _checked(obj: Any, where: str) -> dict[str, torch.Tensor]:
    if isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        # Training checkpoints often nest the weights one level down.
        for key in ("state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                return _checked(inner, f"{where}[{key!r}]")
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{where} holds a {type(obj).__name__}, not a mapping of names to tensors")
    out: dict[str, torch.Tensor] = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{where}: tensor names must be non-empty strings, got {name!r}")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput(f"{where}: tensor name {name!r} is not valid Unicode text; rename it") from None
        if not isinstance(value, torch.Tensor):
            raise InvalidInput(f"{where}: {name!r} is a {type(value).__name__}, not a tensor; keep only tensors")
        out[name] = value
    return out
