"""Modules built without weights and filled with loaded tensors: ``empty_weights``, ``fill_module``.

``with empty_weights(): model = build()`` puts each parameter on the meta device as it is
registered (no storage, no initialisation) and keeps the buffers the constructor computes;
``plan_fill`` checks a module against a checkpoint's names before any byte is fetched, and
``fill_module`` puts loaded tensors in place without copying them (tied weights stay tied).
``worker.loader.load_into`` is the load that ends here; ``worker.loader`` re-exports these names.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch

from worker.errors import FillError

log = logging.getLogger("worker.loader")  # the logger these messages always had: users filter on it


_meta_params = threading.local()  # .depth: how many empty_weights() blocks this thread is inside
_patch_lock = threading.Lock()
_patch_users = 0
_original_register_parameter: Callable[[torch.nn.Module, str, torch.nn.Parameter | None], None] | None = None


def _on_meta(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """``param``'s shape, dtype, ``requires_grad`` and attributes, without storage."""
    data = param.detach().to("meta")
    if type(param) is torch.nn.Parameter:
        meta = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)
        return meta
    # A Parameter subclass keeps its class and its extra fields (as accelerate does it).
    kwargs = dict(param.__dict__)
    kwargs["requires_grad"] = param.requires_grad
    made: torch.nn.Parameter = type(param)(data, **kwargs)
    return made


def _register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    original = _original_register_parameter
    assert original is not None  # set when the patch is installed and never cleared (a call may outlive the patch)
    original(module, name, param)
    if getattr(_meta_params, "depth", 0) <= 0:
        return
    registered = module._parameters.get(name)
    if registered is None or registered.is_meta or isinstance(registered, torch.nn.parameter.UninitializedParameter):
        return
    module._parameters[name] = _on_meta(registered)


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_original_inits: dict[str, Callable[..., Any]] = {}


def _skip_meta_inits() -> None:
    """While ``empty_weights`` is active anywhere: ``torch.nn.init`` on a meta tensor returns it as
    it is. A meta tensor has no values to initialise, and torch runs those inits on meta through
    Python reference decompositions (~10 ms per parameter: most of a module's build time). Real
    tensors are initialised as before, so other threads see no difference."""
    import torch.nn.init as init

    for name in _INITS:
        original = getattr(init, name, None)
        if original is None or name in _original_inits:
            continue
        _original_inits[name] = original

        def skip(tensor: Any, *args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return __original(tensor, *args, **kwargs)

        setattr(init, name, skip)


def _restore_inits() -> None:
    import torch.nn.init as init

    for name, original in _original_inits.items():
        setattr(init, name, original)
    _original_inits.clear()


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with their **parameters** on the meta device and their buffers real.

    ``with empty_weights(): model = BertModel(config)`` allocates no parameter storage (each
    parameter goes to the meta device as it is registered, so its initialisation runs on meta
    and costs nothing), while buffers (``position_ids``, attention masks, rotary tables: values
    the constructor computes and no checkpoint carries) keep the values the constructor gave
    them. ``fill_module`` / ``load_into`` then put the loaded tensors in place and move the
    buffers to the load's device. Like accelerate's ``init_empty_weights(include_buffers=False)``,
    but per thread: a module another thread builds meanwhile is built as usual. Under
    ``torch.device("meta")`` the buffers are on meta too and their values are lost, which is
    why ``fill_module`` refuses such a module when it has non-persistent buffers.
    """
    global _patch_users, _original_register_parameter
    with _patch_lock:
        current = getattr(torch.nn.Module, "register_parameter")  # noqa: B009
        if _patch_users == 0 and current is not _register_parameter:
            _original_register_parameter = current
            setattr(torch.nn.Module, "register_parameter", _register_parameter)  # noqa: B010 - a method patched on purpose
            _skip_meta_inits()
        _patch_users += 1
    _meta_params.depth = getattr(_meta_params, "depth", 0) + 1
    try:
        yield
    finally:
        _meta_params.depth -= 1
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                if getattr(torch.nn.Module, "register_parameter") is _register_parameter:  # noqa: B009 - not replaced since
                    setattr(torch.nn.Module, "register_parameter", _original_register_parameter)  # noqa: B010
                _restore_inits()


@dataclass(frozen=True)
class FillReport:
    """What ``fill_module`` did with each name of the module and of the checkpoint."""

    loaded: tuple[str, ...]  # module entries set from the checkpoint's tensor of the same name
    tied: tuple[tuple[str, str], ...]  # (name, source): shares the tensor loaded for ``source`` (tied weights)
    recomputed: tuple[str, ...]  # checkpoint names of non-persistent buffers: skipped, the constructor's values kept
    unexpected: tuple[str, ...]  # other checkpoint names the module does not have (only with strict=False)
    missing: tuple[str, ...]  # real persistent buffers the checkpoint lacks, kept as built (only with strict=False)


@dataclass(frozen=True)
class _FillPlan:
    report: FillReport
    load: tuple[str, ...]  # checkpoint names handed to load_state_dict
    aliases: tuple[tuple[str, str], ...]  # (name, source) to point at the source's new tensor afterwards


def _shown(names: Sequence[str], limit: int = 8) -> str:
    listed = ", ".join(names[:limit])
    return listed + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _on_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _entries(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """``full name -> (owner, leaf, "param"|"buffer", tensor)`` of every parameter and buffer, aliases included."""
    out: dict[str, tuple[torch.nn.Module, str, str, torch.Tensor]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for leaf, p in sub._parameters.items():
            if p is not None:
                out[f"{prefix}.{leaf}" if prefix else leaf] = (sub, leaf, "param", p)
        for leaf, b in sub._buffers.items():
            if b is not None:
                out[f"{prefix}.{leaf}" if prefix else leaf] = (sub, leaf, "buffer", b)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b.to(a.device)))


def plan_fill(module: torch.nn.Module, names: Sequence[str], strict: bool = True,
              tensors: Mapping[str, torch.Tensor] | None = None) -> _FillPlan:
    """Check ``module`` against the checkpoint ``names`` (before any byte is fetched when ``tensors`` is None).

    Raises FillError naming what does not fit; changes nothing.
    """
    entries = _entries(module)
    expected = {k: v for k, v in module.state_dict(keep_vars=True).items()}
    given = set(names)
    nonpersistent = [n for n, (_, _, kind, _) in entries.items() if kind == "buffer" and n not in expected]

    meta_np = [n for n in nonpersistent if entries[n][3].is_meta]
    if meta_np:
        raise FillError(
            f"non-persistent buffer(s) {_shown(meta_np)} are on the meta device: their values come from the module's "
            "constructor and are in no checkpoint, and a module built under torch.device('meta') has lost them. "
            "Build the module under worker.loader.empty_weights() instead (parameters on meta, buffers real): "
            "`with empty_weights(): model = build()`")

    recomputed = tuple(n for n in names if n not in expected and n in nonpersistent)
    unexpected = tuple(n for n in names if n not in expected and n not in nonpersistent)
    if unexpected and strict:
        raise FillError(f"the checkpoint has {len(unexpected)} tensor(s) the module does not: {_shown(unexpected)}; "
                        "check that the module matches the model version, or pass strict=False to skip them")

    # Names that share one tensor in the module (tied weights): one is loaded, the others point at it.
    groups: dict[int, list[str]] = {}
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(id(value), []).append(name)
    aliases: list[tuple[str, str]] = []
    for group in groups.values():
        present = [n for n in group if n in given]
        if len(group) < 2 or not present:
            continue
        source = present[0]
        if tensors is not None:
            differ = [n for n in present[1:] if not _same(tensors[source], tensors[n])]
            if differ:
                raise FillError(f"{_shown([source, *differ])} are one tied tensor in the module but differ in the "
                                "checkpoint; untie them in the module (e.g. tie_word_embeddings=False) to load both")
        aliases.extend((n, source) for n in group if n != source)
    alias_names = {n for n, _ in aliases}

    load_names = tuple(n for n in expected if n in given and n not in alias_names)
    loaded = set(load_names) | alias_names
    absent = [n for n in expected if n not in loaded]
    # A missing parameter is always an error (a model with one weight left as built computes
    # garbage silently); so is an entry left without storage (meta). Only a real persistent
    # buffer the checkpoint lacks is kept as built, and only under strict=False.
    no_value = [n for n in absent if not isinstance(expected[n], torch.Tensor) or expected[n].is_meta]
    no_value += [n for n, (_, _, _, t) in entries.items() if t.is_meta and n not in loaded and n not in expected]
    params = [n for n in absent if n in entries and entries[n][2] == "param"]
    bad = list(dict.fromkeys([*(absent if strict else params), *no_value]))
    if bad:
        kinds = " and ".join(sorted({"parameter" if n in entries and entries[n][2] == "param" else "buffer" for n in bad}))
        why = ("" if not no_value else "; on the meta device they would have no value" if len(no_value) == len(bad)
               else f"; {_shown(no_value)} on the meta device would have no value")
        raise FillError(f"the checkpoint lacks {len(bad)} {kinds}(s) of the module: {_shown(bad)}{why}")
    report = FillReport(
        loaded=load_names, tied=tuple(aliases), recomputed=recomputed,
        unexpected=unexpected, missing=tuple(absent),
    )
    return _FillPlan(report, load_names, tuple(aliases))


def check_fillable(module: torch.nn.Module) -> None:
    """Raise FillError now if ``fill_module`` could never fill ``module`` (meta non-persistent buffers)."""
    plan_fill(module, [name for name in module.state_dict(keep_vars=True)], strict=False)


def fill_module(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], device: torch.device,
                strict: bool = True, *, values_ready: bool = True) -> FillReport:
    """Put ``tensors`` into ``module`` without copying them; everything else the module holds moves to ``device``.

    ``module`` may be real, or built under ``empty_weights()`` (parameters on meta, buffers as the
    constructor made them), or under ``torch.device("meta")`` if it has no non-persistent buffers.

    - Non-persistent buffers keep the constructor's values; a checkpoint tensor of that name
      (``position_ids`` in older BERT checkpoints) is skipped and reported in ``recomputed``.
    - Any other checkpoint tensor the module lacks is an error under ``strict``, else reported.
    - A parameter or buffer the checkpoint lacks is an error under ``strict``, and always when it
      has no storage (meta); names the module ties to one tensor need only one of them.
    - Tied names stay tied: the others point at the tensor loaded for the first one present.

    ``values_ready=False``: the tensors are still being filled (a cold start serving while its
    weights arrive), so tied names are not compared by value; the full fill after the load does.

    Raises FillError (a RuntimeError) naming what does not fit, before changing anything.
    """
    plan = plan_fill(module, list(tensors), strict, tensors if values_ready else None)
    result = module.load_state_dict({n: tensors[n] for n in plan.load}, strict=False, assign=True)
    if result.unexpected_keys:  # a module whose state-dict hooks rename keys: what it refused is still an error
        raise FillError(f"the module refused checkpoint tensor(s) {_shown(result.unexpected_keys)}")
    entries = _entries(module)
    for name, source in plan.aliases:
        owner, leaf, kind, _ = entries[name]
        tensor = entries[source][3]
        if kind == "param":
            owner._parameters[leaf] = cast(torch.nn.Parameter, tensor)
        else:
            owner._buffers[leaf] = tensor
    _move_rest(module, device)
    r = plan.report
    if r.recomputed:
        log.info("skipped %d checkpoint tensor(s) the module recomputes (non-persistent buffers): %s",
                 len(r.recomputed), _shown(r.recomputed))
    if r.unexpected:
        log.warning("skipped %d checkpoint tensor(s) the module does not have: %s", len(r.unexpected), _shown(r.unexpected))
    if r.missing:
        log.warning("%d module tensor(s) not in the checkpoint kept as built: %s", len(r.missing), _shown(r.missing))
    return r


def _move_rest(module: torch.nn.Module, device: torch.device) -> None:
    """Every parameter and buffer not on ``device`` yet goes there (shared tensors stay shared)."""
    moved: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for leaf, t in table.items():
                if t is None or t.is_meta or _on_device(t, device):
                    continue
                new = moved.get(id(t))
                if new is None:
                    data = t.detach().to(device)
                    new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
                    moved[id(t)] = new
                table[leaf] = new  # type: ignore[assignment]


__all__ = ["FillError", "FillReport", "check_fillable", "empty_weights", "fill_module", "plan_fill"]
