"""A local cluster's files besides its servers' data: secrets (0600), TLS certificates, the client config and
``cluster.json``. ``ClusterFiles`` is ``LocalCluster``'s part that writes them."""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import EXIT_BAD_ARGUMENTS, LauncherError
from .local_layout import (CLIENT_CERT, CLIENT_CONFIG, SECRET_FILES, SECRETS_DIR, STATE_FILE, TLS_DIR, LocalClusterConfig,
                           ServerSlot, config_to_json)

if TYPE_CHECKING:
    from paramserver.client.config import ClientSettings

    from .netns import NetnsTopology


class ClusterFiles:
    """The files of the cluster under ``root``; ``LocalCluster`` sets the attributes below."""

    config: LocalClusterConfig
    root: Path
    slots: list[ServerSlot]
    topology: NetnsTopology | None

    # ---- TLS and the client config ------------------------------------------------------
    @property
    def tls_dir(self) -> Path:
        return self.root / TLS_DIR

    @property
    def client_config_path(self) -> Path:
        return self.root / CLIENT_CONFIG

    def secret_path(self, key: str) -> Path:
        return self.root / SECRETS_DIR / SECRET_FILES[key]

    def _prepare_secrets(self) -> None:
        """Settle the admin token, read token and cluster secret and write each to its 0600 file.

        Given values win; else, when generating, the files of an earlier start are reused (so
        clients keep working across down/up) or fresh ones made. A secret this start does not use
        loses its file.
        """
        c = self.config
        generate = c.generate_secrets or c.netns
        folder = self.root / SECRETS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        values: dict[str, str | None] = {}
        for key in SECRET_FILES:
            value = getattr(c, key)
            if value is None and generate:
                value = read_secret(self.secret_path(key)) or secrets.token_urlsafe(32)
            values[key] = value
            path = self.secret_path(key)
            if value:
                write_private(path, value + "\n")
            elif path.exists():
                path.unlink()
        self.config = replace(c, admin_token=values["admin_token"], read_token=values["read_token"], secret=values["secret"])

    def _make_certs(self) -> None:
        """The CA and one certificate per server (its host in the SANs) plus the client's; existing ones are reused.
        The client's certificate is a worker's (serverAuth on loopback too): local workers that use it serve
        their peers over mutual TLS with it."""
        from .certs import CertError, make_cluster_certs

        try:
            make_cluster_certs(self.tls_dir, {s.server_id: [s.grpc.rpartition(":")[0]] for s in self.slots}, clients=(),
                               workers={CLIENT_CERT: []})
        except (CertError, ValueError, OSError) as exc:
            raise LauncherError(f"cannot make the cluster's TLS certificates in {self.tls_dir}: {exc}") from None

    def client_settings(self, client_cert: str | None = CLIENT_CERT) -> "ClientSettings":
        """How a client reaches this cluster (addresses, tokens, and under TLS the CA and ``client_cert``'s files)."""
        from paramserver.client.config import ClientSettings

        tls: dict[str, Any] = {}
        if self.config.tls:
            tls["tls_ca"] = self.tls_dir / "ca.pem"
            if client_cert is not None:
                tls["tls_cert"], tls["tls_key"] = self.tls_dir / f"{client_cert}.pem", self.tls_dir / f"{client_cert}.key"
        return ClientSettings(cluster=tuple(self.addresses), admin_token=self.config.admin_token,
                              read_token=self.config.read_token, **tls)

    def write_client_config(self) -> Path:
        """Write ``client.toml`` into the cluster folder.

        Paths in it are relative to the folder, so the folder can move; no token sits in the file itself,
        it names the 0600 files under ``secrets/``.
        """
        c = self.config
        lines = [
            "# Client config of the local cluster (python -m deploy.local up); use it with",
            f"#   export PARAMS_CONFIG={self.client_config_path}",
            "# then paramctl and paramworker need no --cluster, --token or --tls-* flags.",
            f"cluster = [{', '.join(json.dumps(a) for a in self.addresses)}]",
        ]
        for key, name in (("admin_token_file", "admin_token"), ("read_token_file", "read_token")):
            if getattr(c, name):
                lines.append(f"{key} = {json.dumps(f'{SECRETS_DIR}/{SECRET_FILES[name]}')}")
        for stale in ("admin.token", "read.token"):  # where launchers before the secrets folder kept them
            if (self.root / stale).exists():
                (self.root / stale).unlink()
        if c.tls:
            lines += [
                f"tls_ca = {json.dumps(f'{TLS_DIR}/ca.pem')}",
                f"tls_cert = {json.dumps(f'{TLS_DIR}/{CLIENT_CERT}.pem')}",
                f"tls_key = {json.dumps(f'{TLS_DIR}/{CLIENT_CERT}.key')}",
            ]
        tmp = self.client_config_path.with_suffix(".toml.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.client_config_path)
        return self.client_config_path

    @property
    def addresses(self) -> list[str]:
        return [s.grpc for s in self.slots]

    @property
    def seed(self) -> str:
        return ",".join(self.addresses)

    # ---- state file -------------------------------------------------------------------
    def save_state(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {"config": config_to_json(self.config), "slots": [asdict(s) for s in self.slots]}
        if self.topology is not None:
            t = self.topology
            data["netns"] = {"prefix": t.prefix, "servers": t.n, "clients": t.config.clients,
                             "subnet": t.subnet if t.has_subnet else None}
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.root / STATE_FILE)


def read_secret(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
        raise LauncherError(f"cannot read the cluster's secret {path} ({why}): run as the user who started the "
                            f"cluster, or fix the file's owner and mode (0600)", EXIT_BAD_ARGUMENTS) from None


def write_private(path: Path, text: str) -> None:
    """Write a secret file atomically, readable by its owner only from the first byte."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    tmp.replace(path)


def read_secrets(root: Path) -> dict[str, str | None]:
    """The cluster's secrets from their files under ``root`` (None where a file is missing or empty)."""
    return {key: read_secret(root / SECRETS_DIR / name) for key, name in SECRET_FILES.items()}
