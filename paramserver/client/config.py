"""The one client configuration: :class:`ClientSettings`, shared by ``paramctl`` and ``paramworker``.

Each value comes from the first of these that sets it:

1. a command-line flag (``--cluster``, ``--token``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ...);
2. the environment: ``PARAMS_CLUSTER``, ``PARAMS_ADMIN_TOKEN``, ``PARAMS_READ_TOKEN``,
   ``PARAMS_TLS_CA``, ``PARAMS_TLS_CERT``, ``PARAMS_TLS_KEY``, ``PARAMS_VERIFY``;
3. the client config file, ``--config FILE`` or ``PARAMS_CONFIG`` (TOML);
4. the defaults.

The config file names token FILES, never tokens, so it can be shared and printed; relative paths
in it resolve against the file's folder::

    cluster = ["127.0.0.1:7000", "127.0.0.1:7002"]   # or "HOST:PORT,HOST:PORT"
    admin_token_file = "admin.token"                 # writes (push, tag, rollback, untag)
    read_token_file = "read.token"                   # reads; the admin token works for reads too
    tls_ca = "tls/ca.pem"                            # the cluster's CA: TLS on
    tls_cert = "tls/client.pem"                      # mutual TLS: this client's certificate ...
    tls_key = "tls/client.key"                       # ... and its key
    verify = "crc"                                   # or "content"
    bulk = true                                      # read over the servers' bulk ports when offered
    timeout_s = 10.0                                 # seconds per unary call

Unknown keys are an error (a typo must not silently drop a setting).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.client.cluster_view import ClusterOptions, parse_seeds
from paramserver.client.errors import ConfigError
from paramserver.client.rpc import ClientConfig

CLUSTER_ENV = "PARAMS_CLUSTER"
ADMIN_TOKEN_ENV = "PARAMS_ADMIN_TOKEN"
READ_TOKEN_ENV = "PARAMS_READ_TOKEN"
TLS_CA_ENV = "PARAMS_TLS_CA"
TLS_CERT_ENV = "PARAMS_TLS_CERT"
TLS_KEY_ENV = "PARAMS_TLS_KEY"
VERIFY_ENV = "PARAMS_VERIFY"
CONFIG_ENV = "PARAMS_CONFIG"

VERIFY_MODES = ("crc", "content")
FILE_KEYS = frozenset({
    "cluster", "admin_token_file", "read_token_file", "tls", "tls_ca", "tls_cert", "tls_key", "verify", "bulk", "timeout_s",
})  # fmt: skip


def _check_pem(name: str, path: Path, where: str) -> None:
    """A TLS file must hold what its name says, in PEM: gRPC would only log its complaint and then
    fail every call as UNAVAILABLE."""
    try:
        text = path.read_bytes()[: 1 << 20]
    except OSError as exc:
        raise ConfigError(f"{name} file {path} cannot be read ({exc.strerror or exc}){where}") from None
    wanted = b"PRIVATE KEY-----" if name == "tls_key" else b"-----BEGIN CERTIFICATE-----"
    if wanted not in text:
        what = "a PEM private key" if name == "tls_key" else "a PEM certificate"
        raise ConfigError(f"{name} file {path} does not hold {what}{where}; give the file 'deploy.local up --tls' or your CA "
                          "issued")


@dataclass(frozen=True)
class ClientSettings:
    """Where the cluster is and how to reach it; see the module docstring for where values come from."""

    cluster: tuple[str, ...] = ()  # seed gRPC addresses (any members)
    admin_token: str | None = None  # writes
    read_token: str | None = None  # reads (the admin token is accepted for reads too)
    tls_ca: Path | None = None  # the cluster's CA; setting it turns TLS on
    tls_cert: Path | None = None  # mutual TLS: the client certificate ...
    tls_key: Path | None = None  # ... and its private key
    verify: str = "crc"  # "crc" or "content"
    bulk: bool = True  # read chunk bytes over the servers' bulk ports when they offer one (never under TLS)
    timeout_s: float = 10.0  # seconds per unary call
    config_file: Path | None = None  # the client config file the values came from, if any
    tls_system_roots: bool = False  # TLS trusting the system's root certificates (no tls_ca)

    @property
    def tls(self) -> bool:
        """True when calls go over TLS (a CA, a client certificate or ``tls = true`` was given)."""
        return self.tls_system_roots or self.tls_ca is not None or self.tls_cert is not None

    @property
    def use_bulk(self) -> bool:
        """Whether to read over bulk ports: asked for, and never under TLS (bulk ports are plaintext)."""
        return self.bulk and not self.tls

    def token_for(self, write: bool) -> str | None:
        """The token a call sends: the admin token for writes; for reads the read token, else the admin one."""
        return self.admin_token if write else (self.read_token or self.admin_token)

    def validate(self) -> ClientSettings:
        where = f" (from {self.config_file})" if self.config_file is not None else ""
        if not self.cluster:
            raise ConfigError(
                f"no cluster address given: pass --cluster HOST:PORT (any member), set {CLUSTER_ENV}, "
                f"or put cluster = [...] in the client config ({CONFIG_ENV})"
            )
        parse_seeds(self.cluster)  # each HOST:PORT
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("tls_cert", "tls_key") if self.tls_cert is not None else ("tls_key", "tls_cert")
            raise ConfigError(
                f"{given} is set but {missing} is not{where}: a client certificate needs its key "
                "(--tls-cert and --tls-key, PARAMS_TLS_CERT and PARAMS_TLS_KEY)"
            )
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name} file {path} does not exist{where}")
            if path is not None:
                _check_pem(name, Path(path), where)
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}{where}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout_s}{where}")
        for name in ("admin_token", "read_token"):
            token = getattr(self, name)
            if token is not None and (not token or any(c.isspace() for c in token)):
                # The value may come from a flag, the environment or the file: name them all, blame none.
                env = ADMIN_TOKEN_ENV if name == "admin_token" else READ_TOKEN_ENV
                source = f", or {self.config_file}" if self.config_file is not None else ""
                raise ConfigError(f"{name} must be a non-empty string without whitespace: check --token / --token-file, "
                                  f"${env}{source}")
        return self

    # ---------------------------------------------------------------- what the client stack takes

    def cluster_options(self, write: bool) -> ClusterOptions:
        """Options for ``ClusterView`` / push / pull, with the token for a write or a read."""
        return ClusterOptions(
            tuple(self.cluster), token=self.token_for(write), timeout_s=self.timeout_s, tls=self.tls,
            tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
        ).validate()  # fmt: skip

    def client_config(self, address: str, *, write: bool = False, timeout_s: float | None = None) -> ClientConfig:
        """A ``ParamServerClient`` config for one server, with these TLS files and the token for ``write``."""
        return ClientConfig(
            address, token=self.token_for(write), timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
            tls=self.tls, tls_ca=self.tls_ca, client_cert=self.tls_cert, client_key=self.tls_key,
        ).validate()  # fmt: skip

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        defaults: ClientSettings | None = None,
    ) -> ClientSettings:
        """Settings from ``flags`` (field name -> value; None = not given; ``config_file`` too), then
        ``environ``, then the client config file, then ``defaults``; validated."""
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        unknown = set(flags) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown client setting(s): {', '.join(sorted(unknown))}")
        environ = os.environ if environ is None else environ
        base = defaults or cls()
        config_file = flags.get("config_file") or _env(environ, CONFIG_ENV)
        from_env = _from_environ(environ)
        for source, what in ((flags, ("--tls-cert", "--tls-key")), (from_env, (TLS_CERT_ENV, TLS_KEY_ENV))):
            if ("tls_cert" in source) != ("tls_key" in source):
                given, missing = what if "tls_cert" in source else what[::-1]
                raise ConfigError(f"{given} is given without {missing}: a client certificate and its key come together")
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        if config_file:
            from_file = read_config_file(Path(config_file))
            values.update(from_file)
            origin.update({k: f"from {config_file}" for k in from_file})
            values["config_file"] = Path(config_file)
        values.update(from_env)
        origin.update({k: f"from {_ENV_NAMES[k]}" for k in from_env})
        values.update(flags)
        origin.update({k: f"from --{k.replace('_', '-')}" for k in flags})
        if "cluster" in values:
            try:
                values["cluster"] = parse_seeds(values["cluster"])
            except ConfigError as exc:
                raise ConfigError(f"{exc} ({origin.get('cluster', 'cluster')})") from None
        for name in ("tls_ca", "tls_cert", "tls_key", "config_file"):
            if values.get(name) is not None:
                values[name] = Path(values[name]).expanduser()
                if name != "config_file" and not values[name].is_file():
                    raise ConfigError(f"{name} file {values[name]} ({origin.get(name, 'given')}) does not exist")
        return dataclasses.replace(base, **values).validate()


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value.strip() if value and value.strip() else None


_ENV_NAMES = {
    "cluster": CLUSTER_ENV, "admin_token": ADMIN_TOKEN_ENV, "read_token": READ_TOKEN_ENV, "tls_ca": TLS_CA_ENV,
    "tls_cert": TLS_CERT_ENV, "tls_key": TLS_KEY_ENV, "verify": VERIFY_ENV,
}  # fmt: skip


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    return {field: value for field, name in _ENV_NAMES.items() if (value := _env(environ, name)) is not None}


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings a client config file gives, as ClientSettings field values (tokens read from their files)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read client config file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"client config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise ConfigError(
            f"client config file {path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(FILE_KEYS))}"
            + (" (tokens go in files: admin_token_file / read_token_file)" if {"admin_token", "read_token", "token"} & set(unknown) else "")
        )
    folder = path.resolve().parent

    def file_path(key: str) -> Path:
        value = data[key]
        if not isinstance(value, str) or not value:
            raise ConfigError(f"client config file {path}: {key} must be a file path (a string), got {value!r}")
        p = Path(value).expanduser()
        return p if p.is_absolute() else folder / p

    out: dict[str, Any] = {}
    if "cluster" in data:
        cluster = data["cluster"]
        if isinstance(cluster, str):
            cluster = [cluster]
        if not isinstance(cluster, list) or not all(isinstance(a, str) for a in cluster):
            raise ConfigError(f"client config file {path}: cluster must be a list of \"HOST:PORT\" strings, got {data['cluster']!r}")
        try:
            out["cluster"] = parse_seeds(cluster)
        except ConfigError as exc:
            raise ConfigError(f"client config file {path}: {exc}") from None
    for key, field in (("admin_token_file", "admin_token"), ("read_token_file", "read_token")):
        if key in data:
            out[field] = read_token_file(file_path(key), f"client config file {path}: {key}")
    for key in ("tls_ca", "tls_cert", "tls_key"):
        if key in data:
            out[key] = file_path(key)
    if "tls" in data:
        if not isinstance(data["tls"], bool):
            raise ConfigError(f"client config file {path}: tls must be true or false, got {data['tls']!r}")
        out["tls_system_roots"] = data["tls"]
    if "verify" in data:
        if data["verify"] not in VERIFY_MODES:
            raise ConfigError(f"client config file {path}: verify must be one of {', '.join(VERIFY_MODES)}, got {data['verify']!r}")
        out["verify"] = data["verify"]
    if "bulk" in data:
        if not isinstance(data["bulk"], bool):
            raise ConfigError(f"client config file {path}: bulk must be true or false, got {data['bulk']!r}")
        out["bulk"] = data["bulk"]
    if "timeout_s" in data:
        t = data["timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"client config file {path}: timeout_s must be a number of seconds > 0, got {t!r}")
        out["timeout_s"] = float(t)
    return out


def read_token_file(token_file: Path, what: str) -> str:
    """The one token in ``token_file``; errors name it as ``what`` (the flag or config key)."""
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{what} {token_file}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {token_file} is not a text file") from None
    if not token or any(c.isspace() for c in token):
        got = "nothing" if not token else "several words"
        raise ConfigError(f"{what} {token_file} must hold one token (no spaces), got {got}")
    return token


# -------------------------------------------------------------------- argparse


def add_client_arguments(parser: argparse.ArgumentParser, *, write: bool, cluster_default: str | None = None) -> None:
    """Add --cluster, --token, --config, --tls, --tls-ca, --tls-cert, --tls-key to ``parser``.

    ``write``: whether the command can write (then --token is the admin token for writes and the
    read token for reads); a read-only command documents --token as the read token. Every flag
    defaults to None so :func:`settings_from_args` can tell "not given" from a value;
    ``cluster_default`` only names, in the help, the address used when no source gives one.
    """
    g = parser.add_argument_group("cluster and credentials (flags > environment > --config file > defaults)")
    g.add_argument("--cluster", default=None, metavar="HOST:PORT[,HOST:PORT]",
                   help=f"gRPC address(es) of any member(s), comma-separated (env {CLUSTER_ENV}; or cluster in the config file; "
                        f"default: {cluster_default or 'none, one must be given'})")
    if write:
        token_help = (f"auth token: the admin token for writes (env {ADMIN_TOKEN_ENV}), the read token for reads "
                      f"(env {READ_TOKEN_ENV}, else the admin token); default: from the environment or the config file's "
                      "admin_token_file/read_token_file, none when unset")
    else:
        token_help = (f"read token (env {READ_TOKEN_ENV}, else {ADMIN_TOKEN_ENV}; or the config file's "
                      "read_token_file/admin_token_file); default: none")
    tokens = g.add_mutually_exclusive_group()
    tokens.add_argument("--token", default=None, help=token_help + "; visible in the process list: prefer --token-file")
    tokens.add_argument("--token-file", default=None, metavar="FILE",
                        help="read the --token from this file (one token; keeps it out of the process list)")
    g.add_argument("--config", dest="config_file", type=Path, default=None, metavar="FILE",
                   help=f"client config file (TOML: cluster, admin_token_file, read_token_file, tls_ca, tls_cert, tls_key, "
                        f"verify, bulk, timeout_s) (env {CONFIG_ENV}; default: none)")
    g.add_argument("--tls", dest="tls_system_roots", action="store_const", const=True, default=None,
                   help="use TLS with the system's root certificates (default: plaintext unless a CA or client certificate is given)")
    g.add_argument("--tls-ca", type=Path, default=None, metavar="FILE",
                   help=f"use TLS and trust this CA for the servers' certificates (env {TLS_CA_ENV}; default: none)")
    g.add_argument("--tls-cert", type=Path, default=None, metavar="FILE",
                   help=f"client certificate for mutual TLS, with --tls-key (env {TLS_CERT_ENV}; default: none)")
    g.add_argument("--tls-key", type=Path, default=None, metavar="FILE",
                   help=f"private key of --tls-cert (env {TLS_KEY_ENV}; default: none)")


def settings_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] = os.environ,
    *,
    write: bool = False,
    defaults: ClientSettings | None = None,
) -> ClientSettings:
    """ClientSettings from parsed flags (see :func:`add_client_arguments`), ``environ`` and the config file.

    ``write``: the command writes, so ``--token`` is the admin token (otherwise the read token).
    Also read when the parser has them: ``--verify`` (``verify``), ``--no-bulk`` (``no_bulk``) and
    ``--timeout`` (``timeout``), each None/False when not given.
    """
    flags: dict[str, Any] = {
        "cluster": getattr(args, "cluster", None),
        "config_file": getattr(args, "config_file", None),
        "tls_system_roots": getattr(args, "tls_system_roots", None),
        "tls_ca": getattr(args, "tls_ca", None),
        "tls_cert": getattr(args, "tls_cert", None),
        "tls_key": getattr(args, "tls_key", None),
        "verify": getattr(args, "verify", None),
        "timeout_s": getattr(args, "timeout", None),
        "bulk": False if getattr(args, "no_bulk", False) else None,
    }
    token = getattr(args, "token", None)
    token_file = getattr(args, "token_file", None)
    if token_file is not None:
        token = read_token_file(Path(token_file), "--token-file")
    if token is not None:
        flags["admin_token" if write else "read_token"] = token
    return ClientSettings.load(flags, environ, defaults=defaults)


# -------------------------------------------------------------------- the Python entry points


def resolve_settings(
    cluster: ClientSettings | str | Sequence[str] | None = None,
    *,
    token: str | None = None,
    write: bool = False,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ClientSettings:
    """The settings a Python entry point (push, pull, the loaders, ``ClusterClient``) runs with.

    The same precedence as the CLIs (:meth:`ClientSettings.load`): the explicit arguments
    (``cluster`` addresses, ``token``, ``config_file`` and ``overrides``: any ClientSettings field,
    e.g. ``tls_ca=``, ``verify=``), then the environment, then the ``PARAMS_CONFIG`` file, then the
    defaults. ``token`` is the admin token when ``write``, else the read token (as ``--token``).
    ``cluster`` given as ClientSettings is already resolved: it is used as it is (``token`` and
    ``overrides`` still win).
    """
    field = "admin_token" if write else "read_token"
    given = {k: v for k, v in {**overrides, field: token}.items() if v is not None}
    if isinstance(cluster, ClientSettings):  # no environment, no file: they were read when it was made
        return ClientSettings.load(given, {}, defaults=cluster) if given else cluster
    return ClientSettings.load({"cluster": cluster, "config_file": config_file, **given}, environ)


def split_cluster_arg(cluster: Any, *given: Any, what: str) -> tuple[Any, ...]:
    """``(cluster, *given)`` of an entry point called as ``f(cluster, a, b)`` or as ``f(a, b)``.

    The cluster argument comes first (as it always did) but may be left out when the settings
    supply it: when the last of ``given`` is missing (None), the arguments shift one place and the
    cluster is None, i.e. taken from the environment or ``PARAMS_CONFIG``. ``what`` names ``given``
    for the error when even the shifted arguments are short.
    """
    if given[-1] is not None:
        return (cluster, *given)
    shifted = (None, cluster, *given[:-1])
    if any(value is None for value in shifted[1:]):
        raise TypeError(f"missing argument(s): {what}")
    return shifted


__all__ = [
    "ADMIN_TOKEN_ENV", "CLUSTER_ENV", "CONFIG_ENV", "ClientSettings", "READ_TOKEN_ENV", "TLS_CA_ENV", "TLS_CERT_ENV",
    "TLS_KEY_ENV", "VERIFY_ENV", "add_client_arguments", "read_config_file", "resolve_settings", "settings_from_args",
    "split_cluster_arg",
]
