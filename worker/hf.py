"""Hugging Face ``transformers`` models straight from the cluster: ``load_pretrained``.

A model folder pushed with ``paramctl push DIR --model M --tag T`` (``save_pretrained``'s
output: ``config.json`` and ``model.safetensors`` or its shards) is a version whose manifest
holds the tensors and, as files, the config. ``load_pretrained(cluster, "M:T")`` reads
``config.json`` from that version, builds the model with its parameters on the meta device
(``worker.loader.empty_weights``: no parameter storage, buffers as the constructor makes them),
fills it through the worker's normal load path (cache tiers, verification, heat) and returns it
in eval mode: the same module ``from_pretrained`` gives, without a local file.

Checkpoint names are matched the way ``from_pretrained`` does in the common case:

- the base-model prefix (``bert.``, ``transformer.``) is stripped from a name when the model
  has the stripped name, and added when the model has the prefixed one, so a
  ``BertForMaskedLM`` checkpoint loads into ``BertModel`` and back;
- names the model does not use are skipped and logged: those of a task head when a base
  model is loaded, those its class lists in ``_keys_to_ignore_on_load_unexpected`` (GPT-2's
  old ``attn.bias`` masks), and non-persistent buffers such as BERT's ``position_ids``;
  any other unknown name is an error (``strict``);
- tied weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) need one of their
  names in the checkpoint and stay one tensor; ``tie_weights()`` runs after the fill.

A parameter the checkpoint lacks is an error naming it (``from_pretrained`` would initialise
it at random; load a checkpoint that has it, or build and initialise that part yourself).

``transformers`` is imported only when a function here runs, so ``import worker.hf`` is cheap
and the worker does not need it unless it serves such a model.
"""
from __future__ import annotations

import importlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chunking.manifest import Manifest
from paramserver.client import folder as client_folder
from paramserver.client.errors import NotFound
from paramserver.client.refs import ModelRef
from paramserver.client.session import ClusterClient, client_for
from worker.config import CacheConfig
from worker.errors import ConfigError, WorkerError
from worker.outputs import json_values
from worker.loader import (
    LoadedModel, close_after_heat, empty_weights, fill_module, load, plan_fill, resolve_device, resolve_ref,
)  # fmt: skip
from worker.tiered_cache import TieredCache

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def _transformers() -> Any:
    """The ``transformers`` module, or a WorkerError saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise WorkerError(f"Hugging Face models need the transformers package ({exc}); "
                          "install it next to torch: pip install transformers") from None


def read_file(client: ClusterClient, manifest: Manifest, path: str) -> bytes:
    """The bytes of the non-tensor file ``path`` of a pushed model folder (``paramserver.client.folder``)."""
    if not manifest.files:
        raise NotFound(f"model {manifest.model}: this version has no {path!r}, it was pushed as a weights file, not a "
                       "folder; push the save_pretrained folder (paramctl push DIR), or build the model yourself "
                       "under worker.loader.empty_weights() and fill it with load_into")
    return client_folder.read_file(client, manifest, path)  # NotFound naming the path if the folder lacks it


def config_from_json(raw: bytes | str | Mapping[str, Any], model_class: Any = None) -> Any:
    """A ``PretrainedConfig`` from ``config.json``'s bytes, as ``AutoConfig.from_pretrained`` makes it."""
    tf = _transformers()
    try:
        doc = dict(raw) if isinstance(raw, Mapping) else json.loads(raw)
    except ValueError as exc:
        raise WorkerError(f"{CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise WorkerError(f"{CONFIG_FILE} must hold a JSON object")
    # A concrete class brings its config class (as Class.from_pretrained does); otherwise the
    # config's model_type picks it (as AutoConfig.from_pretrained does).
    config_class = getattr(model_class, "config_class", None) if model_class is not None else None
    model_type = doc.get("model_type")
    if config_class is None and isinstance(model_type, str):
        mapping = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
        try:
            config_class = mapping[model_type]
        except KeyError:
            raise WorkerError(f"{CONFIG_FILE}: model_type {model_type!r} is unknown to transformers "
                              f"{tf.__version__}; upgrade transformers or pass model_class") from None
    if config_class is None:
        raise WorkerError(f"{CONFIG_FILE} names no model_type; pass model_class")
    return config_class.from_dict(doc)


def resolve_class(name: str | None) -> Any:
    """A transformers model class by name (``BertForMaskedLM``, ``AutoModelForCausalLM``; None = ``AutoModel``)."""
    tf = _transformers()
    short = (name or "AutoModel").removeprefix("transformers.")
    cls = getattr(tf, short, None)
    if cls is None or not (hasattr(cls, "from_config") or hasattr(cls, "config_class")):
        raise ConfigError(f"--hf-class {name!r} is not a transformers model class (e.g. AutoModel, "
                          "AutoModelForCausalLM, BertForMaskedLM)")
    return cls


def build_model(config: Any, model_class: Any = None) -> torch.nn.Module:
    """The model for ``config`` with its parameters on meta and its buffers real (``empty_weights``).

    ``model_class``: a model class (``BertModel``), an auto class (``AutoModelForCausalLM``) or
    None for ``AutoModel`` (the base model, as ``AutoModel.from_pretrained`` gives it).
    """
    cls = model_class if model_class is not None else _transformers().AutoModel
    with empty_weights():
        # Auto classes pick the class for the config (from_config); a model class is built the
        # way they build it (_from_config: the config's dtype and attention implementation).
        if hasattr(cls, "from_config"):
            model = cls.from_config(config)
        elif hasattr(cls, "_from_config"):
            model = cls._from_config(config)
        else:
            model = cls(config)
    if not isinstance(model, torch.nn.Module):
        raise WorkerError(f"{getattr(cls, '__name__', cls)} built a {type(model).__name__}, not a torch module")
    return model


@dataclass(frozen=True)
class KeyMap:
    """How checkpoint names become module names for one model."""

    rename: dict[str, str]  # checkpoint name -> module name (only the names that change)
    skipped: tuple[str, ...]  # checkpoint names the model does not use (head weights, ignored patterns)

    def apply(self, names: Sequence[str]) -> list[str]:
        gone = set(self.skipped)
        return [self.rename.get(n, n) for n in names if n not in gone]


def map_keys(model: torch.nn.Module, names: Sequence[str]) -> KeyMap:
    """Checkpoint names -> the model's, like ``from_pretrained`` (base-model prefix, ignored patterns)."""
    known = set(model.state_dict(keep_vars=True)) | {n for n, _ in model.named_buffers(remove_duplicate=False)}
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    rename: dict[str, str] = {}
    skipped: list[str] = []
    head_checkpoint = bool(prefix) and any(n.startswith(prefix + ".") for n in names)
    base_model = bool(prefix) and not any(k.startswith(prefix + ".") for k in known)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    for name in names:
        target = name
        if name not in known and prefix:
            stripped = name.removeprefix(prefix + ".")
            if stripped != name and stripped in known:
                target = stripped
            elif f"{prefix}.{name}" in known:
                target = f"{prefix}.{name}"
        if target in known:
            if target != name:
                rename[name] = target
        elif any(p.search(name) for p in ignore) or (head_checkpoint and base_model and not name.startswith(prefix + ".")):
            skipped.append(name)  # a task head's weight into the base model, or a name the class says to ignore
    return KeyMap(rename, tuple(skipped))


def fill_pretrained(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], device: torch.device,
                    keys: KeyMap | None = None, strict: bool = True) -> torch.nn.Module:
    """Fill ``model`` (from ``build_model``) with checkpoint ``tensors``, tie its weights, eval mode."""
    keys = keys or map_keys(model, list(tensors))
    if keys.skipped:
        log.info("skipped %d checkpoint tensor(s) %s does not use: %s", len(keys.skipped), type(model).__name__,
                 ", ".join(keys.skipped[:8]) + (" ..." if len(keys.skipped) > 8 else ""))
    gone = set(keys.skipped)
    fill_module(model, {keys.rename.get(n, n): t for n, t in tensors.items() if n not in gone}, device, strict)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model.eval()


def load_pretrained(
    cluster: ClusterClient | str | Sequence[str],
    ref: str | ModelRef,
    model_class: Any = None,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    token: str | None = None,
    *,
    strict: bool = True,
    **kwargs: Any,
) -> Any:
    """The transformers model of ``ref`` (a pushed ``save_pretrained`` folder), filled and in eval mode.

    ``model_class``: e.g. ``BertForMaskedLM`` or ``AutoModelForCausalLM``; None builds
    ``AutoModel`` (the base model). ``kwargs`` go to ``worker.loader.load`` (``config``,
    ``report_heat``, ``on_progress``). Config, key matching and tied weights are checked
    against the manifest before any chunk is fetched.
    """
    dev = resolve_device(device)
    client, owned = client_for(cluster, token)
    loaded: LoadedModel | None = None
    try:
        mref = ModelRef.parse(ref) if isinstance(ref, str) else ref
        info = resolve_ref(client, mref)
        manifest = client.manifest(info.manifest_id)
        config = config_from_json(read_file(client, manifest, CONFIG_FILE), model_class)
        model = build_model(config, model_class)
        names = [t.name for t in manifest.tensors]
        keys = map_keys(model, names)
        plan_fill(model, keys.apply(names), strict)
        loaded = load(client, mref, dev, cache, info=info, manifest=manifest, **kwargs)
        return fill_pretrained(model, loaded.tensors, dev, keys, strict)
    finally:
        if owned:
            close_after_heat(client, loaded)


# ---------------------------------------------------------------------- paramworker serve --hf

def _token_ids(value: Any, what: str, device: torch.device) -> torch.Tensor:
    try:
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f'"{what}" must be a list of equal-length lists of token ids ({exc})') from None
    if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] == 0:
        raise ValueError(f'"{what}" must be a non-empty list of equal-length lists of integers, got shape '
                         f"{tuple(t.shape)} of {t.dtype}")
    return t.to(device)


@dataclass(frozen=True)
class HFServing:
    """What ``paramworker serve --hf`` needs: how to build a version's module and run a request.

    The request contract (``paramworker serve --help`` prints it): ``{"input": [[101, 2023, 102]],
    "attention_mask": [[1, 1, 1]]}`` (token ids, rows of equal length; the mask is optional) or a
    bare list of rows; the answer's ``output`` is the model's ``logits`` when it has them, else
    its ``last_hidden_state``, and ``output_name`` says which.
    """

    model_class: str | None = None  # a transformers class name; None = AutoModel

    @property
    def name(self) -> str:
        """Part of every result key: two classes over the same weights answer differently."""
        return f"hf:{self.model_class or 'AutoModel'}"

    def check(self) -> None:
        resolve_class(self.model_class)

    def build(self, client: ClusterClient, loaded: LoadedModel, device: torch.device) -> torch.nn.Module:
        cls = resolve_class(self.model_class)
        config = config_from_json(read_file(client, loaded.manifest, CONFIG_FILE), cls)
        model = build_model(config, cls)
        return fill_pretrained(model, loaded.tensors, device)

    def forward(self, module: torch.nn.Module, request: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
        """``{"output", "output_name"}`` for one request; ValueError for one the model cannot run."""
        ids = _token_ids(request.get("input"), "input", device)
        extra: dict[str, torch.Tensor] = {}
        if request.get("attention_mask") is not None:
            mask = _token_ids(request["attention_mask"], "attention_mask", device)
            if mask.shape != ids.shape:
                raise ValueError(f'"attention_mask" has shape {tuple(mask.shape)}, "input" {tuple(ids.shape)}')
            extra["attention_mask"] = mask
        with torch.no_grad():
            out = module(input_ids=ids, **extra)
        for field in ("logits", "last_hidden_state"):
            value = getattr(out, field, None)
            if isinstance(value, torch.Tensor):
                return {"output": json_values(value), "output_name": field}
        raise ValueError(f"{type(module).__name__} returned neither logits nor last_hidden_state")


__all__ = [
    "CONFIG_FILE", "HFServing", "KeyMap", "build_model", "config_from_json", "fill_pretrained",
    "load_pretrained", "map_keys", "read_file", "resolve_class",
]
