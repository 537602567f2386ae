"""vLLM loads its weights straight from the cluster: ``--load-format pdparams``.

Installed with pdparams (the entry point ``pdparams`` in the group ``vllm.general_plugins``), so
``vllm serve DIR --load-format pdparams --model-loader-extra-config '{"ref": "MODEL:TAG"}'`` and
``vllm.LLM(DIR, load_format="pdparams", model_loader_extra_config={"ref": ...})`` find it with no
code from the user. ``DIR`` holds the version's non-weight files (``paramctl pull MODEL:TAG
--out-dir DIR --no-weights``): vLLM reads the config and tokenizer from it before any weight.

How a load runs (docs/vllm.md):

- In the process that builds the engine's configuration (``EngineArgs.create_engine_config``),
  before any engine process starts, the plugin checks the loader's options, resolves the
  reference once (a tag at the leader) and pins it: every engine process (each tensor-parallel
  rank) then loads exactly that version, and a bad reference, a missing token or an unreachable
  cluster stops the start with one line (``PdparamsLoadError``), not a traceback from an engine
  process. The folder's ``config.json`` must be the version's own.
- In each engine process, ``load_weights`` feeds the model's own ``load_weights`` an iterator of
  ``(name, tensor)`` (``worker.weight_stream``): each tensor as soon as its chunks have landed
  and verified, in heatmap order, so vLLM's renames, fused projections and sharding apply
  unchanged. The tensors are in host memory; no weight byte is written to disk unless a disk tier
  is configured (``disk_cache``).
- The process keeps its client for its lifetime: the memory and disk tiers and its peer port
  serve other workers (fan-out), and the load's heat goes to the servers as for any worker load.

Tensor parallelism: vLLM hands each rank's model the whole checkpoint tensor and the model's weight
loaders cut the rank's slice, so each rank fetches every tensor (as vLLM's own safetensors loader
reads every tensor); ranks on one host read each other's chunks through their peer ports, so the
servers send about one copy per host, not one per rank.

This module imports vLLM only inside :func:`register` (the entry point): importing pdparams never
imports vLLM.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from chunking.folder import file_hash
from paramserver.client.config import ClientSettings, resolve_settings
from paramserver.client.errors import ClientError
from paramserver.client.exit_codes import BAD_ARGUMENTS, describe_failure, one_line
from paramserver.client.hostmem import default_pool
from paramserver.client.refs import ModelRef
from paramserver.client.session import ClusterClient, VersionInfo
from worker.config import MIB, CacheConfig, PrefetchConfig
from worker.errors import WorkerError
from worker.tiered_cache import TieredCache

# Under "vllm": vLLM configures that logger (format, level) in every process it starts.
log = logging.getLogger("vllm.pdparams")

LOAD_FORMAT = "pdparams"
# The reference the configuration process resolved, handed to the engine processes in the
# loader's extra config (not a user option: every rank loads that one version).
PINNED_KEY = "_pinned"
RECIPE = ("paramctl pull MODEL:TAG --out-dir DIR --no-weights, then vllm serve DIR --load-format pdparams "
          "--model-loader-extra-config '{\"ref\": \"MODEL:TAG\"}'")


class PdparamsLoadError(WorkerError, ValueError):
    """vLLM cannot load from the cluster; the message is one line saying what to do.

    ``exit_code`` is paramctl's code for the same failure (docs/operations.md): 2 bad options,
    3 not found, 5 token or certificate refused, 6 cluster unavailable, 8 data loss.
    """

    def __init__(self, message: str, exit_code: int = BAD_ARGUMENTS) -> None:
        super().__init__(one_line(f"pdparams: {message}"))
        self.exit_code = exit_code


@dataclass(frozen=True)
class LoaderOptions:
    """``--model-loader-extra-config`` of ``--load-format pdparams`` (a JSON object)."""

    ref: str
    cluster: tuple[str, ...] = ()  # seed addresses; default: PARAMS_CLUSTER or the PARAMS_CONFIG file
    # Memory tier (LRU-K) in MiB, as paramworker --cache-mb. 0 by default, unlike paramworker: the
    # weights live in the engine after the load, and a tier the model's size would keep a second
    # copy in host RAM per engine process (per tensor-parallel rank) for the process's life. Set
    # it to let peers read this process's chunks from memory after its load.
    cache_mb: int = 0
    disk_cache: str | None = None  # disk tier directory, as paramworker --disk-cache; default none
    disk_cache_mb: int = 16384
    peers: bool | None = None  # None: on unless PARAMS_PEERS=off
    verify: str | None = None  # crc | content; default PARAMS_VERIFY or crc
    pinned: str | None = None  # MODEL@N, set by the configuration process

    FIELDS = ("ref", "cluster", "cache_mb", "disk_cache", "disk_cache_mb", "peers", "verify")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> LoaderOptions:
        """Parse and check the extra config; every mistake is one PdparamsLoadError line."""
        if not isinstance(extra, Mapping):
            raise PdparamsLoadError(f"--model-loader-extra-config must be a JSON object like {{\"ref\": \"MODEL:TAG\"}}, "
                                    f"got {type(extra).__name__}")
        if "token" in extra or "read_token" in extra:
            raise PdparamsLoadError("a token does not go in --model-loader-extra-config (it would be visible in the process "
                                    "list): set PARAMS_READ_TOKEN or put read_token in the PARAMS_CONFIG file")
        unknown = sorted(set(extra) - set(cls.FIELDS) - {PINNED_KEY})
        if unknown:
            raise PdparamsLoadError(f"unknown --model-loader-extra-config key(s) {', '.join(unknown)}; "
                                    f"the keys are {', '.join(cls.FIELDS)}")
        ref = extra.get("ref")
        if not isinstance(ref, str) or not ref.strip():
            raise PdparamsLoadError(f"--model-loader-extra-config needs \"ref\": \"MODEL:TAG\" (or MODEL@N), the version "
                                    f"to load; the recipe: {RECIPE}")
        try:
            ModelRef.parse(ref)
        except ClientError as exc:
            raise PdparamsLoadError(f"ref {ref!r}: {exc}") from None
        cluster = extra.get("cluster", ())
        if isinstance(cluster, str):
            cluster = tuple(a.strip() for a in cluster.split(",") if a.strip())
        if not isinstance(cluster, (tuple, list)) or not all(isinstance(a, str) for a in cluster):
            raise PdparamsLoadError("cluster must be \"HOST:PORT,HOST:PORT\" or a list of such strings")
        opts = cls(
            ref=ref.strip(), cluster=tuple(cluster),
            cache_mb=_int(extra, "cache_mb", cls.cache_mb, 0, 16 << 20),
            disk_cache=_str_or_none(extra, "disk_cache"),
            disk_cache_mb=_int(extra, "disk_cache_mb", cls.disk_cache_mb, 1, 64 << 20),
            peers=_bool_or_none(extra, "peers"),
            verify=_str_or_none(extra, "verify"),
            pinned=_str_or_none(extra, PINNED_KEY),
        )
        if opts.verify not in (None, "crc", "content"):
            raise PdparamsLoadError(f"verify must be \"crc\" or \"content\", got {opts.verify!r}")
        return opts

    @property
    def load_ref(self) -> str:
        """What the engine processes load: the pinned version when the configuration process pinned one."""
        return self.pinned or self.ref

    def settings(self) -> ClientSettings:
        overrides: dict[str, Any] = {"verify": self.verify} if self.verify else {}
        try:
            return resolve_settings(self.cluster or None, **overrides).validate()
        except ClientError as exc:
            raise PdparamsLoadError(str(exc), describe_failure(exc).code) from None

    def cache_config(self) -> CacheConfig | None:
        if self.cache_mb == 0 and self.disk_cache is None:
            return None
        # fsync per chunk off as for paramworker: the disk tier is a cache verified on every read.
        return CacheConfig(memory_bytes=self.cache_mb * MIB, disk_dir=self.disk_cache,
                           disk_bytes=self.disk_cache_mb * MIB if self.disk_cache else 0, disk_fsync=False).validate()


def _int(extra: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PdparamsLoadError(f"{key} must be a whole number from {low} to {high}, got {value!r}")
    return value


def _str_or_none(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise PdparamsLoadError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _bool_or_none(extra: Mapping[str, Any], key: str) -> bool | None:
    value = extra.get(key)
    if value is not None and not isinstance(value, bool):
        raise PdparamsLoadError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass
class Runtime:
    """One process's client and cache tiers, kept for its lifetime (its peer port serves from them).

    The tiers open on the first load (``cache()``): the configuration process only resolves, and
    must not scan (or share) the engine processes' disk tier."""

    client: ClusterClient
    options: LoaderOptions
    _cache: TieredCache | None = None
    _opened: bool = False

    def cache(self, rank: int | None = None) -> TieredCache | None:
        """The tiers; ``rank`` (a tensor-parallel rank of several): its own disk tier directory under
        ``disk_cache``, since a disk tier belongs to one process (it clears its ``tmp/`` on open)."""
        if not self._opened:
            config = self.options.cache_config()
            if config is not None and config.disk_dir is not None and rank is not None:
                config = replace(config, disk_dir=str(Path(config.disk_dir) / f"rank{rank}"))
            try:
                self._cache = TieredCache.from_config(config) if config is not None else None
            except WorkerError as exc:
                raise PdparamsLoadError(f"disk_cache {self.options.disk_cache}: {exc}") from None
            self._opened = True
        return self._cache


_runtimes: dict[tuple[Any, ...], Runtime] = {}
_runtimes_lock = threading.Lock()


def runtime_for(opts: LoaderOptions) -> Runtime:
    """The process's runtime for these options and the settings they resolve to now (a changed
    PARAMS_CONFIG or token between two engines of one process gets a new client)."""
    settings = opts.settings()
    key = (settings, opts.cache_mb, opts.disk_cache, opts.disk_cache_mb)
    with _runtimes_lock:
        rt = _runtimes.get(key)
        if rt is None:
            rt = _runtimes[key] = Runtime(ClusterClient(settings=settings), opts)
        return rt


def _failure(exc: BaseException, what: str, client: ClusterClient) -> PdparamsLoadError:
    # With the settings, "unavailable" that is really a TLS refusal says so (exit 5), as paramctl does.
    failure = describe_failure(exc, client.settings)
    return PdparamsLoadError(f"{what}: {failure.message}", failure.code)


def resolve(opts: LoaderOptions, client: ClusterClient | None = None) -> VersionInfo:
    """Resolve the options' reference, a tag at the leader (linearizable: a start right after a tag
    move sees it, even from a client that resolved the tag before); expected failures are one line."""
    client = client or runtime_for(opts).client
    try:
        return client.resolve_ref(ModelRef.parse(opts.load_ref), linearizable=True)
    except (ClientError, OSError) as exc:
        raise _failure(exc, f"cannot resolve {opts.load_ref}", client) from None


def check_folder(client: ClusterClient, info: VersionInfo, folder: str) -> None:
    """The model folder vLLM reads its config, generation config and tokenizer from must hold this
    version's own files: a folder pulled before the tag moved would describe another model (or
    template, or tokenizer) than the weights loaded. Every file of the version found in the folder
    is compared by BLAKE3; files the folder lacks are not required (vLLM may take them elsewhere)."""
    root = Path(folder)
    if not root.is_dir():
        return  # a Hugging Face repo id or another source: nothing local to compare
    try:
        manifest = client.manifest(info.manifest_id)
    except (ClientError, OSError) as exc:
        raise _failure(exc, f"cannot read the manifest of {info.model} v{info.number}", client) from None
    for entry in manifest.files:
        local = root / entry.path
        if local.is_file() and file_hash(local) != entry.blake3:
            raise PdparamsLoadError(
                f"{local} is not the {entry.path} of {info.model} v{info.number} (was the folder pulled for another "
                f"version, before the tag moved?): pull it again with paramctl pull {info.model}@{info.number} "
                "--out-dir NEWDIR --no-weights")


def check_local(opts: LoaderOptions, client: ClusterClient) -> None:
    """What an engine process would otherwise find wrong only after its start, with a traceback:
    the tiers' settings, a disk tier directory it cannot write, the peer port's settings
    (``PARAMS_PEERS``, ``PARAMS_PEER_LISTEN``, ``PARAMS_PEER_ADVERTISE``) and its exposure."""
    from worker.peer_link import PeerLink, PeerLinkConfig

    try:
        config = opts.cache_config()
        if config is not None and config.disk_dir is not None:
            disk = Path(config.disk_dir)
            try:
                disk.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise PdparamsLoadError(f"disk_cache {disk}: cannot create it ({exc.strerror}); give a writable directory") from None
            if not os.access(disk, os.W_OK | os.X_OK):
                raise PdparamsLoadError(f"disk_cache {disk}: not writable by this user; give a writable directory")
        if opts.peers is not False:
            peer = PeerLinkConfig.from_env(enabled=opts.peers)
            if peer.enabled:
                PeerLink(client, None, peer).check_exposure(client.options.token)
    except WorkerError as exc:
        if isinstance(exc, PdparamsLoadError):
            raise
        raise PdparamsLoadError(f"{exc} (for a vLLM load: the environment variables PARAMS_PEER_LISTEN, "
                                "PARAMS_PEER_ADVERTISE, PARAMS_PEERS, or the extra config)") from None


def preflight(extra: Mapping[str, Any] | None, folder: str | None, nodes: int = 1) -> dict[str, Any]:
    """Check the options and the cluster before any engine process starts; returns the extra config
    with the resolved version pinned (``MODEL@N``) for the engine processes.

    ``nodes`` > 1 (vLLM across several hosts, each starting its own engine processes from its own
    configuration): each host would resolve a tag on its own, and two hosts could load two versions
    across a tag move, so only ``MODEL@N`` is taken there."""
    opts = LoaderOptions.from_extra(extra)
    ref = ModelRef.parse(opts.ref)
    if nodes > 1 and ref.version is None:
        raise PdparamsLoadError(f"ref {opts.ref!r}: vLLM spans {nodes} nodes here and each resolves a tag on its own, so "
                                "give the exact version (MODEL@N, e.g. from paramctl ls) on every node")
    client = runtime_for(opts).client
    check_local(opts, client)
    info = resolve(replace(opts, pinned=None), client)
    if folder is not None:
        check_folder(client, info, folder)
    pinned = f"{info.model}@{info.number}"
    log.info("pdparams: %s is %s (manifest %s)%s", opts.ref, pinned, info.manifest_id[:12],
             f"; tag read from a {info.read}" if info.read and info.read != "leader" else "")
    return {**dict(extra or {}), PINNED_KEY: pinned}


def stream_for(opts: LoaderOptions, rank: int | None = None) -> Any:
    """The weight iterator of one engine process's load (``worker.weight_stream.WeightStream``);
    ``rank``: this process's rank when there are several (its own disk tier directory)."""
    from worker.weight_stream import stream_weights

    rt = runtime_for(opts)
    info = resolve(opts, rt.client)
    try:
        return stream_weights(rt.client, opts.load_ref, cache=rt.cache(rank), info=info, peers=opts.peers,
                              config=PrefetchConfig())
    except (ClientError, OSError) as exc:
        raise _failure(exc, f"cannot load {opts.load_ref}", rt.client) from None
    except WorkerError as exc:
        raise PdparamsLoadError(f"cannot load {opts.load_ref}: {exc}") from None


def _rank() -> int | None:
    """This process's global rank when vLLM runs several (tensor or pipeline parallel), else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


def check_loaded(model: Any, loaded: Iterable[str] | None, quantized: bool) -> None:
    """Every parameter of an unquantized model came from the checkpoint (vLLM's default loader's rule)."""
    if loaded is None or quantized:
        return
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        raise PdparamsLoadError(f"{len(missing)} parameter(s) of the model were not in the version's tensors, e.g. "
                                f"{', '.join(missing[:5])}: is the folder's config.json the one of this version?")


def _excepthook(previous: Any) -> Any:
    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if isinstance(exc, PdparamsLoadError):  # an expected failure: one line and paramctl's exit code
            print(f"{Path(sys.argv[0]).name or 'vllm'}: error: {exc}", file=sys.stderr)
            raise SystemExit(exc.exit_code)
        previous(kind, exc, tb)

    hook.pdparams = True  # type: ignore[attr-defined]
    return hook


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``--load-format pdparams``.

    vLLM calls it in every process it starts (it may call it more than once): it registers the
    loader class, wraps ``EngineArgs.create_engine_config`` with the preflight (once), and makes an
    uncaught ``PdparamsLoadError`` print one line and exit with its code instead of a traceback.
    """
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import register_model_loader

        register_model_loader(LOAD_FORMAT)(_loader_class())
    except Exception as exc:  # noqa: BLE001 - a vLLM this plugin does not fit must still start its other loaders
        log.warning("pdparams: --load-format pdparams is not available with this vLLM (%s: %s); docs/vllm.md names "
                    "the tested version", type(exc).__name__, exc)
        return
    create = EngineArgs.create_engine_config
    if not getattr(create, "pdparams", False):
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            config = create(self, *args, **kwargs)
            load = config.load_config
            if str(load.load_format).lower() == LOAD_FORMAT:
                nodes = int(getattr(config.parallel_config, "nnodes", 1) or 1)
                load.model_loader_extra_config = preflight(load.model_loader_extra_config, config.model_config.model, nodes)
            return config

        create_engine_config.pdparams = True  # type: ignore[attr-defined]
        EngineArgs.create_engine_config = create_engine_config
    if not getattr(sys.excepthook, "pdparams", False):
        sys.excepthook = _excepthook(sys.excepthook)


_LOADER: type | None = None


def _loader_class() -> type:
    """The ``BaseModelLoader`` subclass, defined once vLLM is importable."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class PdparamsModelLoader(BaseModelLoader):  # type: ignore[misc]
        """``--load-format pdparams``: the weights of ``model_loader_extra_config["ref"]`` from the cluster."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = LoaderOptions.from_extra(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            resolve(self.options)  # nothing to download: the weights stream at load time; the reference must resolve

        def load_weights(self, model: Any, model_config: Any) -> None:
            t0 = time.perf_counter()
            stream = stream_for(self.options, _rank())
            loaded = model.load_weights(iter(stream))
            check_loaded(model, loaded, model_config.quantization is not None)
            seconds = time.perf_counter() - t0
            summary = stream.report.summary()
            del stream  # the engine holds its own copy now: the host arena goes back ...
            gc.collect()
            default_pool().release_all()  # ... to the OS at once, before vLLM measures the memory left for its KV cache
            log.info("Loading weights took %.2f seconds", seconds)
            log.info("pdparams: %s; host memory still held by pdparams: %.3f GiB", summary,
                     sum(default_pool().held_bytes()) / (1 << 30))

    _LOADER = PdparamsModelLoader
    return PdparamsModelLoader


__all__ = ["LOAD_FORMAT", "LoaderOptions", "PdparamsLoadError", "check_folder", "check_loaded", "preflight", "register",
           "resolve", "runtime_for", "stream_for"]
