"""A private certificate authority and certificates for a local mutual-TLS cluster.

    certs = make_cluster_certs(Path(".cluster/tls"), {"ps1": ["10.77.0.2"], "ps2": ["10.77.0.3"]})
    certs.ca.cert, certs.servers["ps1"].cert, certs.clients["client"].key

Every key is EC P-256, written atomically (temporary file in the same folder, then
``os.replace``) and created with mode 0600, so it is never readable by others, not even
for a moment. Certificates are written the same way with mode 0644.

``make_cluster_certs`` is idempotent: the CA in the folder is reused (a restarted
cluster keeps its trust root), and a certificate is issued only when it is missing or no
longer fits (unreadable, signed by another CA, expired, or lacking a host or usage).

This module holds no product logic and imports nothing from the product packages.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.errors import CertError as CertError  # re-exported: its old home

if sys.platform != "win32":  # POSIX only; without it concurrent callers are simply not serialised
    import fcntl

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "CertError",
    "CertPaths",
    "ClusterCerts",
    "issue",
    "load_ca",
    "make_ca",
    "make_cluster_certs",
]

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
LOCK_FILE = ".certs.lock"
CLOCK_SKEW = dt.timedelta(minutes=5)  # certificates start a little in the past
RENEW_BEFORE = dt.timedelta(days=1)  # a reused certificate must be valid at least this long
LOOPBACK_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DNS_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

CAKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey



def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates (and CRLs) only; a server or client certificate signs handshakes only."""
    return x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                         encipher_only=False, decipher_only=False)


@dataclass(frozen=True)
class CertPaths:
    """Where one certificate and its private key lie."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterCerts:
    """The CA plus one certificate per server id, per client name and per worker name."""

    ca: CertPaths
    servers: dict[str, CertPaths] = field(default_factory=dict)
    clients: dict[str, CertPaths] = field(default_factory=dict)
    workers: dict[str, CertPaths] = field(default_factory=dict)


# ---------------------------------------------------------------- public API


def make_ca(folder: Path, *, name: str = "pdparams local CA", days: int = 365) -> CertPaths:
    """Write a new self-signed CA (``ca.pem``, ``ca.key`` with mode 0600) into ``folder``.

    An existing CA in the folder is replaced; ``make_cluster_certs`` reuses one instead.
    """
    _check_days(days)
    if not name.strip() or "\n" in name:
        raise ValueError(f"CA name must be a non-empty single line, got {name!r}")
    folder = _ensure_folder(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage(ca=True),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    paths = CertPaths(cert=folder / CA_CERT, key=folder / CA_KEY)
    # Key first: a ca.pem on disk always has its key beside it.
    _write_atomic(paths.key, _key_pem(key), mode=0o600)
    _write_atomic(paths.cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return paths


def load_ca(folder: Path) -> CertPaths:
    """The CA already in ``folder``, checked (readable, a CA, key matches, not expired).

    Raises ``CertError`` naming the file when either file is missing, unreadable or damaged.
    """
    paths = CertPaths(cert=Path(folder) / CA_CERT, key=Path(folder) / CA_KEY)
    _load_ca_pair(paths)
    return paths


def issue(
    folder: Path,
    ca: CertPaths,
    name: str,
    *,
    hosts: Sequence[str],
    server: bool,
    client: bool,
    days: int = 365,
) -> CertPaths:
    """Issue ``<name>.pem`` / ``<name>.key`` (EC P-256, mode 0600) signed by ``ca``.

    CN is ``name``; every host goes into subjectAltName (IP literals as IPAddress, other
    names as DNSName); extendedKeyUsage carries serverAuth and/or clientAuth as asked.
    The certificate never outlives the CA.
    """
    _check_name(name)
    _check_days(days)
    if not (server or client):
        raise ValueError(f"certificate {name!r}: ask for server and/or client usage")
    if isinstance(hosts, str):
        raise ValueError(f"certificate {name!r}: hosts must be a sequence of names, not one string")
    sans = _parse_hosts(hosts)
    ca_cert, ca_key = _load_ca_pair(ca)
    folder = _ensure_folder(folder)

    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(max(now - CLOCK_SKEW, ca_cert.not_valid_before_utc))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(ca=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())

    paths = CertPaths(cert=folder / f"{name}.pem", key=folder / f"{name}.key")
    _write_atomic(paths.key, _key_pem(key), mode=0o600)
    _write_atomic(paths.cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return paths


def make_cluster_certs(
    folder: Path,
    servers: Mapping[str, Sequence[str]],
    clients: Sequence[str] = ("client",),
    workers: Mapping[str, Sequence[str]] | None = None,
) -> ClusterCerts:
    """A CA plus certificates for every server id, client name and worker name, reusing what fits.

    Server certificates carry serverAuth AND clientAuth (servers call each other over
    mutual TLS) and list their hosts plus ``localhost`` / ``127.0.0.1``; client
    certificates carry clientAuth only. Worker certificates are made like servers' (a worker
    reads the cluster as a client and serves its peers chunks: its peer port needs serverAuth
    for its hosts). An existing CA is reused (``CertError`` if it is damaged); a certificate is
    (re)issued when missing or when it no longer fits.
    """
    workers = dict(workers or {})
    if isinstance(clients, str):
        raise ValueError("clients must be a sequence of names, not one string")
    for sid in [*servers, *workers]:
        _check_name(sid)
    for cname in clients:
        _check_name(cname)
    clash = (set(servers) & set(clients)) | (set(workers) & (set(servers) | set(clients)))
    if clash:
        raise ValueError(f"names used for both a server and a client: {', '.join(sorted(clash))}")
    if len(set(clients)) != len(clients):
        raise ValueError(f"duplicate client names in {list(clients)!r}")

    folder = _ensure_folder(folder)
    with _folder_lock(folder):
        if (folder / CA_CERT).exists():
            ca = load_ca(folder)
        else:
            ca = make_ca(folder)
        ca_cert, _ = _load_ca_pair(ca)

        server_paths: dict[str, CertPaths] = {}
        worker_paths: dict[str, CertPaths] = {}
        for kind, named, paths in (("server", servers, server_paths), ("worker", workers, worker_paths)):
            for sid, hosts in named.items():
                if isinstance(hosts, str):
                    raise ValueError(f"{kind} {sid!r}: hosts must be a sequence of names, not one string")
                wanted = _dedupe([*hosts, *LOOPBACK_HOSTS])
                paths[sid] = _reuse_or_issue(folder, ca, ca_cert, sid, wanted, server=True, client=True)

        client_paths: dict[str, CertPaths] = {}
        for cname in clients:
            client_paths[cname] = _reuse_or_issue(folder, ca, ca_cert, cname, [], server=False, client=True)

    return ClusterCerts(ca=ca, servers=server_paths, clients=client_paths, workers=worker_paths)


# ---------------------------------------------------------------- helpers


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be a whole number >= 1, got {days!r}")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith((".pem", ".key")):
        raise ValueError(
            f"certificate name must be 1-64 of [A-Za-z0-9._-] starting with a letter or digit, got {name!r}"
        )
    if name == "ca":
        raise ValueError("certificate name 'ca' is reserved for the CA")


def _dedupe(items: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        key = item.strip().lower()
        if key not in seen:
            seen.add(key)
            out.append(item.strip())
    return out


def _parse_hosts(hosts: Sequence[str]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = []
    seen: set[x509.GeneralName] = set()
    for raw in hosts:
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError(f"host must be a non-empty string, got {raw!r}")
        host = raw.strip()
        entry: x509.GeneralName
        try:
            entry = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            name = host.rstrip(".").lower()
            labels = name.split(".")
            if labels[0] == "*":  # a leading wildcard label is allowed
                labels = labels[1:]
            if not labels or len(name) > 253 or not all(_DNS_LABEL_RE.match(lab) for lab in labels):
                raise ValueError(f"host {raw!r} is neither an IP address nor a DNS name") from None
            entry = x509.DNSName(name)
        if entry not in seen:
            seen.add(entry)
            sans.append(entry)
    return sans


def _ensure_folder(folder: Path) -> Path:
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Serialise concurrent ``make_cluster_certs`` calls on one folder (POSIX)."""
    if sys.platform == "win32":  # pragma: no cover - no flock there
        yield
        return
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_atomic(path: Path, data: bytes, *, mode: int) -> None:
    """Write ``data`` to ``path`` through a 0600 temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CertError(f"{path}: cannot read {what}: {exc.strerror or _one_line(exc)}") from None


def _load_cert(path: Path, what: str) -> x509.Certificate:
    data = _read(path, what)
    try:
        return x509.load_pem_x509_certificate(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise CertError(f"{path}: damaged {what}, not a PEM certificate ({_one_line(exc)})") from None


def _load_key(path: Path, what: str) -> object:
    data = _read(path, what)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise CertError(f"{path}: damaged {what}, not an unencrypted PEM private key ({_one_line(exc)})") from None


def _same_public_key(cert: x509.Certificate, key: object) -> bool:
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*fmt) == cert.public_key().public_bytes(*fmt)


def _load_ca_pair(ca: CertPaths) -> tuple[x509.Certificate, CAKey]:
    cert = _load_cert(ca.cert, "CA certificate")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = constraints.ca
    except x509.ExtensionNotFound:
        is_ca = False
    except ValueError as exc:
        raise CertError(f"{ca.cert}: damaged CA certificate extensions ({_one_line(exc)})") from None
    if not is_ca:
        raise CertError(f"{ca.cert}: not a CA certificate (basicConstraints CA:TRUE missing)")
    if cert.not_valid_after_utc <= _now():
        raise CertError(f"{ca.cert}: CA certificate expired on {cert.not_valid_after_utc.isoformat()}")
    key = _load_key(ca.key, "CA key")
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise CertError(f"{ca.key}: CA key type {type(key).__name__} is not supported (EC or RSA)")
    if not _same_public_key(cert, key):
        raise CertError(f"{ca.key}: CA key does not match the certificate {ca.cert.name}")
    return cert, key


def _fits(
    paths: CertPaths,
    ca_cert: x509.Certificate,
    name: str,
    hosts: Sequence[str],
    *,
    server: bool,
    client: bool,
) -> bool:
    """Whether an existing certificate can be kept: same CA, valid, right name/hosts/usages."""
    try:
        cert = x509.load_pem_x509_certificate(paths.cert.read_bytes())
        key = serialization.load_pem_private_key(paths.key.read_bytes(), password=None)
        if not _same_public_key(cert, key) or cert.issuer != ca_cert.subject:
            return False
        cert.verify_directly_issued_by(ca_cert)
        if cert.not_valid_after_utc - RENEW_BEFORE <= _now():
            return False
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if [a.value for a in cns] != [name]:
            return False
        ekus = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        wanted_ekus = ({ExtendedKeyUsageOID.SERVER_AUTH} if server else set()) | (
            {ExtendedKeyUsageOID.CLIENT_AUTH} if client else set()
        )
        if ekus != wanted_ekus:
            return False
        wanted_sans = set(_parse_hosts(hosts))
        try:
            have_sans = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        except x509.ExtensionNotFound:
            have_sans = set()
        return wanted_sans <= have_sans
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm, InvalidSignature, x509.ExtensionNotFound):
        return False


def _reuse_or_issue(
    folder: Path,
    ca: CertPaths,
    ca_cert: x509.Certificate,
    name: str,
    hosts: Sequence[str],
    *,
    server: bool,
    client: bool,
) -> CertPaths:
    paths = CertPaths(cert=folder / f"{name}.pem", key=folder / f"{name}.key")
    if _fits(paths, ca_cert, name, hosts, server=server, client=client):
        return paths
    return issue(folder, ca, name, hosts=hosts, server=server, client=client)
