"""The deployment files, checked without a cluster, a container engine or systemd running:

- ``deploy/k8s/``: every manifest against the pinned Kubernetes API schemas (kubernetes-validate,
  strict: an unknown field fails), and against the code: the servers' TOMLs load as ``ServerConfig``,
  the containers' args parse with the real ``paramserver`` / ``paramworker`` / ``paramrouter`` parsers,
  the router's probe paths answer on a real router, probes, ports, annotations, DNS names, secret
  mounts, the PodDisruptionBudgets and the NetworkPolicies (who reaches whom) agree with each other;
- ``Dockerfile`` / ``.dockerignore``: multi-stage, non-root, torch pinned as in pyproject, no secrets;
- ``deploy/systemd/``: the hardening keys, the secrets as credentials, ``systemd-analyze verify`` and
  ``systemd-analyze security --offline`` where systemd-analyze exists;
- ``deploy/monitoring/``: ``promtool check rules``, ``promtool test rules``, ``promtool check config``
  where promtool exists (Debian: apt-get install -y prometheus).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from paramserver.client.config import FILE_KEYS, read_config_file, settings_from_args
from paramserver.server.cli import _parser as paramserver_parser
from paramserver.server.config import SECRET_KEYS, ServerConfig
from paramserver.server.store import StoreConfig
from worker.cli import build_parser as paramworker_parser
from worker.router import Router, RouterOptions
from worker.router import build_parser as paramrouter_parser

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SYSTEMD = REPO / "deploy" / "systemd"
MONITORING = REPO / "deploy" / "monitoring"

# The Kubernetes versions the manifests are pinned to: the oldest supported and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
NAMESPACE = "pdparams"
CLUSTER_DOMAIN = "cluster.local"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not installed (Debian: apt-get install -y prometheus)")
needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed (Debian: apt-get install -y systemd)")


# ---------------------------------------------------------------- Kubernetes


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, for every manifest in deploy/k8s (examples included)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in manifest_files():
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    return resources()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_for_the_pinned_kubernetes_versions(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    from kubernetes_validate.utils import validate

    files = manifest_files()
    assert len(files) >= 9
    checked = 0
    for path in files:
        for doc in documents(path):
            try:
                validate(doc, version, strict=True)
            except kubernetes_validate.utils.ValidationError as exc:
                pytest.fail(f"{path.relative_to(REPO)} {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): "
                            f"{'.'.join(str(p) for p in exc.path)}: {exc.message}")
            checked += 1
    assert checked >= 11


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The check above really is strict: a misspelt field fails."""
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    from kubernetes_validate.utils import ValidationError, validate

    doc = documents(K8S / "12-paramserver-statefulset.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(ValidationError):
        validate(doc, KUBERNETES_VERSIONS[0], strict=True)


def test_every_resource_lives_in_the_namespace(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert ("Namespace", NAMESPACE) in k8s
    for (kind, name), doc in k8s.items():
        if kind != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{kind}/{name}"


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def _expand(args: list[str], pod: str) -> list[str]:
    return [a.replace("$(POD_NAME)", pod) for a in args]


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _write_secrets(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, value in (("cluster.secret", "s" * 32), ("admin.token", "admin-token-123"), ("read.token", "read-token-123"),
                        ("worker.token", "worker-token-123"), ("prewarm.token", "prewarm-token-123")):
        path = folder / name
        path.write_text(value + "\n")
        path.chmod(0o600)
        files[name] = path
    return files


def _server_toml(k8s: dict[tuple[str, str], dict[str, Any]], pod: str) -> dict[str, Any]:
    return tomllib.loads(k8s[("ConfigMap", "paramserver-config")]["data"][f"{pod}.toml"])


def test_statefulset_headless_service_and_pdb_keep_a_majority(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    sts = k8s[("StatefulSet", "paramserver")]
    spec = sts["spec"]
    replicas = spec["replicas"]
    assert replicas == 3 and spec["podManagementPolicy"] == "Parallel"
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()

    svc = k8s[("Service", spec["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None", "the StatefulSet's service must be headless (one DNS name per pod)"
    assert svc["spec"]["publishNotReadyAddresses"] is True, "peers must resolve before they are Ready, or no one elects"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    container = _container(sts)
    ports = _ports(container)
    assert {p["targetPort"] for p in svc["spec"]["ports"]} >= {"grpc", "raft"}
    assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])

    pdb = k8s[("PodDisruptionBudget", "paramserver")]
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert pdb["spec"]["minAvailable"] == 2 and 2 * pdb["spec"]["minAvailable"] > replicas, "a disruption must leave a majority"

    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert claim["metadata"]["name"] in mounts
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    for pod in (f"paramserver-{i}" for i in range(replicas)):
        data_dir = Path(_server_toml(k8s, pod)["data_dir"])
        assert data_dir.is_relative_to(mounts[claim["metadata"]["name"]]), "data_dir must be on the pod's volume"
        assert data_dir != Path(mounts[claim["metadata"]["name"]]), "a subfolder: a fresh volume's root may hold lost+found"


def unknown_keys(config: ServerConfig) -> list[str]:
    """Keys of a config file that no ServerConfig field takes (a typo would be silently ignored as "extra");
    the secret-file keys, which from_mapping also leaves in extra once read, do not count."""
    StoreConfig.from_extra(config.extra)  # what `paramserver serve` checks before it starts
    return sorted(set(config.extra) - {f"{k}_file" for k in SECRET_KEYS})


def test_each_servers_toml_loads_and_names_its_stable_addresses(k8s: dict[tuple[str, str], dict[str, Any]],
                                                                 tmp_path: Path) -> None:
    sts = k8s[("StatefulSet", "paramserver")]
    service = sts["spec"]["serviceName"]
    replicas = sts["spec"]["replicas"]
    container = _container(sts)
    ports = _ports(container)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    config_map = k8s[("ConfigMap", "paramserver-config")]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(replicas)]
    assert sorted(config_map["data"]) == sorted(f"{p}.toml" for p in pods)
    secret_mount = mounts["secrets"]["mountPath"]
    secret_name = volumes["secrets"]["secret"]["secretName"]
    example_keys = set(k8s[("Secret", secret_name)]["stringData"])
    secrets = _write_secrets(tmp_path / "secrets")

    def dns(pod: str, port: int) -> str:
        return f"{pod}.{service}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:{port}"

    for pod in pods:
        raw = _server_toml(k8s, pod)
        for key in SECRET_KEYS:
            path = Path(raw[f"{key}_file"])  # every secret given, as a file on the secret volume
            assert path.parent == Path(secret_mount) and path.name in example_keys, path
            raw[f"{key}_file"] = str(secrets[path.name])
        assert not set(SECRET_KEYS) & set(raw), "secret values never in the ConfigMap"
        args = paramserver_parser().parse_args(_expand(container["args"], pod))
        config_path = Path(args.config)
        assert config_path.parent == Path(mounts["config"]["mountPath"]) and config_path.name == f"{pod}.toml"
        config = ServerConfig.from_mapping(raw)
        assert not unknown_keys(config), f"{pod}.toml has keys ServerConfig does not know: {unknown_keys(config)}"
        assert config.server_id == pod
        assert config.raft == dns(pod, ports["raft"])
        assert config.advertise_address == dns(pod, ports["grpc"])
        assert config.listen == f"0.0.0.0:{ports['grpc']}"
        assert config.bulk_listen == f"0.0.0.0:{ports['bulk']}" and config.bulk_enabled
        assert sorted(config.peers) == sorted(dns(p, ports["raft"]) for p in pods if p != pod)
        assert config.admin_token and config.cluster_secret and config.read_token
        assert args.metrics_port == ports["metrics"]
        assert config.fsync, "never --no-fsync in production"


def test_probes_use_the_grpc_health_service_on_the_grpc_port(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    container = _container(k8s[("StatefulSet", "paramserver")])
    grpc_port = _ports(container)["grpc"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": grpc_port}, probe
    # the health service itself is checked against a live server in test_monitoring.py


def _pod_specs(k8s: dict[tuple[str, str], dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for (kind, name), doc in k8s.items():
        if kind in ("StatefulSet", "Deployment"):
            yield f"{kind}/{name}", doc["spec"]["template"]["spec"]


def test_pods_run_restricted_and_get_secrets_only_as_files(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    secret_words = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY", re.IGNORECASE)
    workloads = dict(_pod_specs(k8s))
    assert set(workloads) == {"StatefulSet/paramserver", "Deployment/paramworker", "StatefulSet/paramrouter"}
    for where, spec in workloads.items():
        assert spec["automountServiceAccountToken"] is False, where
        pod_ctx = spec["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] != 0, where
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not any("hostPath" in v for v in spec["volumes"]), f"{where}: hostPath is not allowed under 'restricted'"
        for c in spec["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
            for arg in c["command"] + c["args"]:
                assert arg not in ("--token", "--admin-token", "--read-token", "--cluster-secret"), f"{where}: a secret in args"
            for env in c.get("env", []):
                if "valueFrom" in env and "secretKeyRef" in env["valueFrom"]:
                    # the one secret the code takes only from the environment: a Redis URL with a password
                    assert env["name"] == "PARAMS_RESULT_CACHE_REDIS", f"{where}: secret {env['name']} in env"
                else:
                    assert not secret_words.search(env["name"]), f"{where}: {env['name']} in env"
        for v in spec["volumes"]:
            if "secret" in v:
                assert v["secret"]["defaultMode"] == 0o440, f"{where}: secret files readable by the pod's group only"
    assert k8s[("Namespace", NAMESPACE)]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_example_secrets_are_empty_so_a_server_refuses_them(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    examples = [doc for (kind, _), doc in k8s.items() if kind == "Secret"]
    assert examples and all(set(doc["stringData"].values()) == {""} for doc in examples)
    assert not list(K8S.glob("*secret*.yaml")), "Secrets stay out of deploy/k8s/ itself (kubectl apply -f must not overwrite them)"


def test_worker_deployment_matches_the_worker_cli(k8s: dict[tuple[str, str], dict[str, Any]], tmp_path: Path) -> None:
    deployment = k8s[("Deployment", "paramworker")]
    pod = deployment["spec"]["template"]
    container = _container(deployment)
    assert container["command"] == ["paramworker"]
    args = paramworker_parser().parse_args(container["args"])
    assert args.cmd == "serve"
    assert re.fullmatch(r"[\w.]+:\w+", args.factory), "--factory package.module:function"
    assert ":" in args.model or "@" in args.model
    ports = _ports(container)
    assert args.listen == f"0.0.0.0:{ports['http']}"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    # the disk tier and the monotonic-read file on the node-local volume
    assert "emptyDir" in volumes["cache"] and Path(args.disk_cache).is_relative_to(mounts["cache"])
    assert Path(args.monotonic_file).is_relative_to(mounts["cache"])
    size_limit = volumes["cache"]["emptyDir"]["sizeLimit"]
    assert size_limit.endswith("Gi") and int(size_limit[:-2]) * 1024 > args.disk_cache_mb
    # the Redis URL from a Secret, optional
    (redis,) = [e for e in container["env"] if e["name"] == "PARAMS_RESULT_CACHE_REDIS"]
    assert redis["valueFrom"]["secretKeyRef"]["optional"] is True
    # with it, the workers' shared L2 key from the same Secret, as a file (issue 41)
    key = Path(args.result_cache_key_file)
    (key_volume,) = [volumes[m["name"]]["secret"] for m in container["volumeMounts"] if m["mountPath"] == str(key.parent)]
    assert key_volume["secretName"] == redis["valueFrom"]["secretKeyRef"]["name"] and key_volume["optional"] is True
    assert key_volume["items"] == [{"key": "result-cache.key", "path": key.name}]
    # the read token (never the admin token), and the client config names it by its mounted path; the
    # worker token (beats) and the pre-warm token (its HTTP port off loopback needs one) as files
    token_volume = volumes["token"]["secret"]
    assert token_volume["items"] == [{"key": k, "path": k} for k in ("read.token", "worker.token", "prewarm.token")]
    assert Path(args.worker_token_file) == Path(mounts["token"]) / "worker.token"
    assert Path(args.admin_token_file) == Path(mounts["token"]) / "prewarm.token"
    config_path = Path(args.config_file)
    assert config_path.parent == Path(mounts["client-config"]) and config_path.name in k8s[("ConfigMap", "paramworker-config")]["data"]
    toml_text = k8s[("ConfigMap", "paramworker-config")]["data"][config_path.name]
    raw = tomllib.loads(toml_text)
    assert set(raw) <= FILE_KEYS
    assert Path(raw["read_token_file"]) == Path(mounts["token"]) / "read.token"
    secrets = _write_secrets(tmp_path / "secrets")
    local = tmp_path / "client.toml"
    local.write_text(toml_text.replace(raw["read_token_file"], str(secrets["read.token"])))
    settings = read_config_file(local)
    assert settings["read_token"] == "read-token-123"
    sts = k8s[("StatefulSet", "paramserver")]
    servers = [_server_toml(k8s, f"paramserver-{i}") for i in range(sts["spec"]["replicas"])]
    assert list(settings["cluster"]) == [s["advertise"] for s in servers]
    # probes, the Service and the allowed-client label
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    svc = k8s[("Service", "paramworker")]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["pdparams.io/client"] == "true"


def test_metrics_ports_are_annotated_for_prometheus(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    expected = {"paramserver": "metrics", "paramworker": "http", "paramrouter": "http"}
    for (kind, name), doc in k8s.items():
        if kind not in ("StatefulSet", "Deployment"):
            continue
        notes = doc["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        assert int(notes["prometheus.io/port"]) == _ports(_container(doc))[expected[name]], name


def test_network_policy_keeps_raft_to_the_servers(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    policy = k8s[("NetworkPolicy", "paramserver")]["spec"]
    server_labels = k8s[("StatefulSet", "paramserver")]["spec"]["selector"]["matchLabels"]
    assert policy["podSelector"]["matchLabels"] == server_labels
    for rule in policy["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if "raft" in ports:
            assert rule["from"] == [{"podSelector": {"matchLabels": server_labels}}]


# ---------------------------------------------------------------- the routers


def _router_dns(k8s: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """http://POD.SERVICE.NAMESPACE.svc.DOMAIN:PORT of every router pod (the StatefulSet's stable names)."""
    sts = k8s[("StatefulSet", "paramrouter")]
    port = _ports(_container(sts))["http"]
    return [f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:{port}"
            for i in range(sts["spec"]["replicas"])]


def test_router_statefulset_matches_the_router_cli(k8s: dict[tuple[str, str], dict[str, Any]], tmp_path: Path) -> None:
    sts = k8s[("StatefulSet", "paramrouter")]
    spec = sts["spec"]
    pod = spec["template"]
    pod_labels = pod["metadata"]["labels"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    assert "volumeClaimTemplates" not in spec, "the routers' state is soft: nothing to keep"
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    container = _container(sts)
    assert container["command"] == ["paramrouter"]
    args = paramrouter_parser().parse_args(container["args"])
    ports = _ports(container)
    assert args.listen == f"0.0.0.0:{ports['http']}"
    assert args.token is None and args.token_file is not None, "the read token as a file, never in args"
    # the read token (never the admin token), from the servers' Secret, at the path --token-file names;
    # the worker token beats must carry and the pre-warm token (off loopback the router needs both)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    token = volumes["token"]["secret"]
    assert token["secretName"] == "paramserver-secrets"
    assert token["items"] == [{"key": k, "path": k} for k in ("read.token", "worker.token", "prewarm.token")]
    assert Path(args.token_file) == Path(mounts["token"]) / "read.token"
    assert Path(args.worker_token_file) == Path(mounts["token"]) / "worker.token"
    assert Path(args.admin_token_file) == Path(mounts["token"]) / "prewarm.token"
    # --cluster: the servers' stable gRPC addresses; the token file is read as the router reads it
    secrets = _write_secrets(tmp_path / "secrets")
    args.token_file = str(secrets["read.token"])
    settings = settings_from_args(args, {}, write=False)
    servers = [_server_toml(k8s, f"paramserver-{i}") for i in range(k8s[("StatefulSet", "paramserver")]["spec"]["replicas"])]
    assert list(settings.cluster) == [s["advertise"] for s in servers]
    assert settings.token_for(write=False) == "read-token-123"
    # the headless Service gives the stable names (published before Ready: beats fill the table first) ...
    headless = k8s[("Service", spec["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    # ... and the clients' Service balances over the Ready routers
    client_svc = k8s[("Service", "paramrouter")]
    assert client_svc["spec"].get("clusterIP") != "None"
    for svc in (headless, client_svc):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(ports["http"], "http")]
    # a router is Ready only after one lease of beats; in-flight requests may finish after SIGTERM
    assert container["readinessProbe"]["initialDelaySeconds"] >= args.lease_s
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.request_timeout_s
    # allowed to the servers' gRPC port (tag resolution) like the workers
    assert pod_labels["pdparams.io/client"] == "true"
    pdb = k8s[("PodDisruptionBudget", "paramrouter")]
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]


def test_router_probes_and_metrics_path_answer_on_a_real_router(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The probes' and the prometheus.io/path annotation's paths, asked of worker.router's own app."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    sts = k8s[("StatefulSet", "paramrouter")]
    container = _container(sts)
    paths = set()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["port"] == "http", probe
            paths.add(container[probe]["httpGet"]["path"])
    assert paths == {"/healthz"}
    metrics_path = sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]

    async def ask() -> dict[str, tuple[int, str]]:
        async with TestClient(TestServer(Router(RouterOptions()).app())) as client:
            out = {}
            for path in (*paths, metrics_path, "/workers", "/no-such-endpoint"):
                r = await client.get(path)
                out[path] = (r.status, await r.text())
            return out

    answers = asyncio.run(ask())
    assert answers["/no-such-endpoint"][0] == 404, "the router answers 404 for what it does not serve"
    for path in (*paths, metrics_path, "/workers"):
        assert answers[path][0] == 200, f"GET {path}: {answers[path]}"
    assert "pdparams_router_workers" in answers[metrics_path][1]


def test_workers_register_with_every_router_pod_at_their_own_ip(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    container = _container(k8s[("Deployment", "paramworker")])
    args = paramworker_parser().parse_args(container["args"])
    # one --router per router pod, by its stable name: every router sees every worker
    assert args.router == _router_dns(k8s)
    assert all(url.startswith("http://") for url in args.router)  # what ParamWorker.register accepts
    # --advertise the pod's own IP (downward API) and the port it listens on; the routers name it by its pod
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert args.advertise == f"$(POD_IP):{_ports(container)['http']}"
    assert args.worker_id == "$(POD_NAME)"
    expanded = paramworker_parser().parse_args([a.replace("$(POD_IP)", "10.1.2.3").replace("$(POD_NAME)", "paramworker-x")
                                                for a in container["args"]])
    assert expanded.advertise == "10.1.2.3:8080" and not expanded.advertise.startswith("0.0.0.0:")


def test_workers_serve_peers_on_their_peer_port_at_their_own_ip(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Fleet fan-out (issue 42): the peer port listens on every address, is a named containerPort, and
    is advertised at the pod's own IP; the flags pass the worker's own checks once expanded."""
    from worker.peer_link import PeerLinkConfig

    container = _container(k8s[("Deployment", "paramworker")])
    port = _ports(container)["peer"]
    args = paramworker_parser().parse_args(container["args"])
    assert not args.no_peers
    assert args.peer_listen == f"0.0.0.0:{port}" and args.peer_advertise == f"$(POD_IP):{port}"
    expanded = paramworker_parser().parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in container["args"]])
    config = PeerLinkConfig.from_env({}, listen=expanded.peer_listen, advertise=expanded.peer_advertise)
    assert config.enabled and config.advertise == f"10.1.2.3:{port}"
    # Off loopback the peer port needs the read token: the worker has one (its client config), never --insecure.
    assert not args.insecure
    assert "read_token_file" in k8s[("ConfigMap", "paramworker-config")]["data"]["client.toml"]


def _peer_allows(peer: dict[str, Any], policy_ns: str, pod_labels: dict[str, str], ns_labels: dict[str, str]) -> bool:
    """Whether one NetworkPolicy ``from`` peer admits a pod (matchLabels only, as these manifests use)."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    for selector in (peer.get("podSelector"), peer.get("namespaceSelector")):
        assert selector is None or set(selector) <= {"matchLabels"}, peer
    if "namespaceSelector" in peer:
        if not peer["namespaceSelector"].get("matchLabels", {}).items() <= ns_labels.items():
            return False
    elif ns_labels.get("kubernetes.io/metadata.name") != policy_ns:
        return False  # a podSelector alone selects pods of the policy's own namespace
    return "podSelector" not in peer or peer["podSelector"].get("matchLabels", {}).items() <= pod_labels.items()


def _allowed(k8s: dict[tuple[str, str], dict[str, Any]], target: str, port: str, pod_labels: dict[str, str],
             namespace: str = NAMESPACE, ns_labels: dict[str, str] | None = None) -> bool:
    """Whether the NetworkPolicy named ``target`` lets a pod with ``pod_labels`` in ``namespace`` reach ``port``."""
    policy = k8s[("NetworkPolicy", target)]
    ns = {"kubernetes.io/metadata.name": namespace, **(ns_labels or {})}
    return any(port in {p["port"] for p in rule["ports"]}
               and any(_peer_allows(peer, policy["metadata"]["namespace"], pod_labels, ns) for peer in rule["from"])
               for rule in policy["spec"]["ingress"])


def test_network_policies_let_workers_routers_and_clients_reach_each_other(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    labels = {name: k8s[(kind, name)]["spec"]["template"]["metadata"]["labels"]
              for kind, name in (("StatefulSet", "paramserver"), ("Deployment", "paramworker"), ("StatefulSet", "paramrouter"))}
    for name in ("paramworker", "paramrouter"):
        policy = k8s[("NetworkPolicy", name)]["spec"]
        assert policy["podSelector"]["matchLabels"].items() <= labels[name].items()
        assert policy["policyTypes"] == ["Ingress"]
        # every port a rule names is one of the pods' ports
        container_ports = set(_ports(_container(k8s[("StatefulSet" if name == "paramrouter" else "Deployment", name)])))
        assert {p["port"] for rule in policy["ingress"] for p in rule["ports"]} <= container_ports
    client = {"pdparams.io/router-client": "true"}
    assert _allowed(k8s, "paramworker", "http", labels["paramrouter"]), "routers forward to the workers"
    assert _allowed(k8s, "paramrouter", "http", labels["paramworker"]), "workers beat to the routers"
    assert _allowed(k8s, "paramrouter", "http", client), "labelled clients reach the routers"
    assert _allowed(k8s, "paramrouter", "http", {}, "apps", client), "pods of a labelled namespace reach the routers"
    assert _allowed(k8s, "paramworker", "http", client), "labelled clients may call the workers directly"
    assert _allowed(k8s, "paramworker", "peer", labels["paramworker"]), "workers read chunks from each other"
    for who, ns in ((labels["paramrouter"], NAMESPACE), (client, NAMESPACE), ({}, "monitoring"), (labels["paramworker"], "apps")):
        assert not _allowed(k8s, "paramworker", "peer", who, ns), f"only the workers reach the peer port, not {who} in {ns}"
    assert _allowed(k8s, "paramserver", "grpc", labels["paramrouter"]), "routers resolve tags over the servers' gRPC"
    assert not _allowed(k8s, "paramserver", "raft", labels["paramrouter"])
    for name in ("paramworker", "paramrouter"):
        assert _allowed(k8s, name, "http", {}, "monitoring"), f"Prometheus scrapes {name}"
        assert not _allowed(k8s, name, "http", {}), f"an unlabelled pod does not reach {name}"
        assert not _allowed(k8s, name, "http", client, "apps"), f"a labelled pod of an unlabelled namespace does not reach {name}"


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def _pyproject_pin(name: str) -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(rf"{name}\s*==", d)]
    return pin.split("==", 1)[1].strip()


def test_dockerfile_is_multi_stage_non_root_and_pins_torch_like_the_project(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    steps = dockerfile_instructions((REPO / "Dockerfile").read_text())
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    stages = [re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", steps[i][1], re.IGNORECASE) for i in froms]
    assert all(stages), "every stage is named (FROM image AS name)"
    names = [m.group(2) for m in stages if m]
    final = steps[froms[-1]:]
    users = [arg for word, arg in final if word == "USER"]
    assert users, "the runtime stage sets a USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root") and uid.isdigit(), "a numeric non-root USER (Kubernetes can verify runAsNonRoot)"
    for _, spec in _pod_specs(k8s):
        assert spec["securityContext"]["runAsUser"] == int(uid)
    assert any(word == "COPY" and arg.startswith(f"--from={names[0]} ") for word, arg in final), "the runtime copies the build"
    assert not any(word == "RUN" and "pip install" in arg for word, arg in final), "nothing is built in the runtime stage"

    args = {}
    for word, arg in steps:
        if word == "ARG":
            key, _, default = arg.partition("=")
            args[key] = default
    assert args["TORCH_VERSION"] == _pyproject_pin("torch"), "the image's torch is the project's pin"
    assert "TORCH_INDEX_URL" in args and args["TORCH_INDEX_URL"] == "", "CPU torch by default, a build ARG for a CUDA build"
    secret_words = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE", re.IGNORECASE)
    for word, arg in steps:
        if word in ("ARG", "ENV"):
            for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", arg) or [arg.split()[0]]:
                assert not secret_words.search(name), f"{word} {name}: secrets never go into an image"
        assert word != "ADD", "COPY only (ADD fetches URLs and unpacks archives)"
    exposed = {int(p) for word, arg in final if word == "EXPOSE" for p in arg.split()}
    for (kind, _), doc in k8s.items():
        if kind in ("StatefulSet", "Deployment"):
            assert set(_ports(_container(doc)).values()) <= exposed

    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "**", ".dockerignore starts by excluding everything"
    included = {line[1:] for line in ignore if line.startswith("!")}
    for word, arg in steps:
        if word == "COPY" and not arg.startswith("--from"):
            *sources, _dest = shlex.split(arg)
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: no such path"
                assert src in included, f"COPY {src}: excluded by .dockerignore"
    for pattern in ("**/secrets", "**/*.secret", "**/*.token", "**/*.key", "**/.cluster"):
        assert pattern in ignore, f".dockerignore must exclude {pattern}"
    assert not {".venv", ".git", "tests"} & included


# ---------------------------------------------------------------- systemd


def unit_file(path: Path) -> dict[str, list[tuple[str, str]]]:
    """section -> [(key, value)] of a systemd unit file (continuations joined, keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    section = None
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        stripped, pending = pending + stripped, ""
        if stripped.startswith("["):
            section = stripped.strip("[]")
            sections[section] = []
            continue
        assert section is not None, f"{path.name}: a key before any section"
        key, sep, value = stripped.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {stripped!r}"
        sections[section].append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], key: str, section: str = "Service") -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


UNITS = ("paramserver@.service", "paramworker.service")
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
             "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "ProtectKernelTunables": "yes",
             "ProtectKernelModules": "yes", "ProtectControlGroups": "yes", "CapabilityBoundingSet": "",
             "UMask": "0077"}


@pytest.mark.parametrize("name", UNITS)
def test_unit_is_hardened_and_takes_secrets_as_credentials(name: str) -> None:
    unit = unit_file(SYSTEMD / name)
    for key, want in HARDENING.items():
        assert values(unit, key) == [want], f"{name}: {key}={want}"
    (user,) = values(unit, "User")
    assert user not in ("root", "0") and values(unit, "Group") == [user]
    assert values(unit, "ReadWritePaths"), f"{name}: ReadWritePaths for its data"
    assert values(unit, "SystemCallFilter")[0] == "@system-service"
    credentials = dict(v.split(":", 1) for v in values(unit, "LoadCredential"))
    assert all(Path(src).is_absolute() for src in credentials.values())
    assert not values(unit, "Environment"), "no secrets (nor anything else) inline in the unit"
    (exec_start,) = values(unit, "ExecStart")
    for flag in ("--token", "--admin-token", "--read-token", "--cluster-secret"):
        assert flag not in shlex.split(exec_start), f"{name}: {flag} VALUE would show the secret in ps"
    assert "read.token" in credentials


def test_server_unit_runs_the_cli_with_credential_files_and_the_example_config(tmp_path: Path) -> None:
    unit = unit_file(SYSTEMD / "paramserver@.service")
    (exec_start,) = values(unit, "ExecStart")
    argv = shlex.split(exec_start.replace("%i", "ps1").replace("%d", "/run/credentials/paramserver@ps1.service"))
    assert argv[0] == "/opt/pdparams/bin/paramserver"
    args = paramserver_parser().parse_args(argv[1:])
    credentials = dict(v.split(":", 1) for v in values(unit, "LoadCredential"))
    for key in SECRET_KEYS:
        path = getattr(args, f"{key}_file")
        assert path is not None and str(path.parent) == "/run/credentials/paramserver@ps1.service", key
        assert path.name in credentials, f"{path.name} is a LoadCredential"
    assert args.config == Path("/etc/pdparams/ps1.toml") and args.metrics_port
    # the example config loads, with the credentials the unit hands over, and its data dir is writable
    secrets = _write_secrets(tmp_path)
    raw = tomllib.loads((SYSTEMD / "paramserver.toml.example").read_text())
    assert not {f"{k}_file" for k in SECRET_KEYS} & set(raw), "the unit gives the secret files"
    config = ServerConfig.from_mapping(raw, **{f"{k}_file": secrets[getattr(args, f"{k}_file").name] for k in SECRET_KEYS})
    assert not unknown_keys(config), unknown_keys(config)
    writable = [Path(p.replace("%i", "ps1")) for p in values(unit, "ReadWritePaths")]
    assert any(config.data_dir.is_relative_to(p) for p in writable)
    assert values(unit, "StateDirectory") == ["paramserver/%i"] and config.data_dir == Path("/var/lib/paramserver/ps1")
    assert "2" in values(unit, "RestartPreventExitStatus")[0].split(), "a bad config (exit 2) is not restarted in a loop"


def test_worker_unit_runs_the_cli_with_its_env_file_and_client_config(tmp_path: Path) -> None:
    unit = unit_file(SYSTEMD / "paramworker.service")
    env = dict(line.split("=", 1) for line in (SYSTEMD / "paramworker.env.example").read_text().splitlines()
               if line and not line.startswith("#"))
    (exec_start,) = values(unit, "ExecStart")
    used = set(re.findall(r"\$\{(\w+)\}", exec_start))
    assert used == set(env), "the env file sets exactly what ExecStart uses"
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], exec_start).replace("%d", "/run/credentials/paramworker.service")
    argv = shlex.split(line)
    args = paramworker_parser().parse_args(argv[1:])
    writable = [Path(p) for p in values(unit, "ReadWritePaths")]
    assert any(Path(args.disk_cache).is_relative_to(p) for p in writable)
    assert any(Path(args.monotonic_file).is_relative_to(p) for p in writable)
    # the peer port (issue 42): off loopback, at an address the other workers dial, the read token its credential
    from worker.peer_link import PeerLinkConfig

    peers = PeerLinkConfig.from_env({}, listen=args.peer_listen, advertise=args.peer_advertise)
    assert peers.enabled and peers.listener("read-token").reachable and not peers.listener("read-token").open
    credentials = dict(v.split(":", 1) for v in values(unit, "LoadCredential"))
    assert Path(args.config_file).name in credentials
    # the worker token and the pre-warm token (its --listen is not loopback) as credentials too
    assert Path(args.worker_token_file).name in credentials and Path(args.admin_token_file).name in credentials
    # the workers' shared L2 key (issue 41): a credential, empty by default (read only once Redis is set)
    key = Path(args.result_cache_key_file)
    assert str(key.parent) == "/run/credentials/paramworker.service" and key.name in credentials
    assert f"{key.name}:unset" in values(unit, "SetCredential")  # too short to be a key: refused if Redis is set
    # the client config, as the credentials folder holds it: its relative read_token_file is the credential
    folder = tmp_path / "credentials"
    folder.mkdir()
    (folder / "client.toml").write_text((SYSTEMD / "paramworker-client.toml.example").read_text())
    (folder / "read.token").write_text("read-token-123\n")
    settings = read_config_file(folder / "client.toml")
    assert settings["read_token"] == "read-token-123" and len(settings["cluster"]) == 3


@pytest.fixture(scope="module")
def systemd_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file-system root holding the units, stand-in executables and the system's own units."""
    root = tmp_path_factory.mktemp("systemd-root")
    system = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)
    if system is None:
        pytest.skip("no /usr/lib/systemd/system to verify against")
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for name in UNITS:
        shutil.copy(SYSTEMD / name, units / name)
    bin_dir = root / "opt/pdparams/bin"
    bin_dir.mkdir(parents=True)
    for exe in ("paramserver", "paramworker"):
        (bin_dir / exe).write_text("#!/bin/sh\n")
        (bin_dir / exe).chmod(0o755)
    return root


@needs_systemd_analyze
@pytest.mark.parametrize("instance", ["paramserver@ps1.service", "paramworker.service"])
def test_systemd_analyze_verify_is_silent(systemd_root: Path, instance: str) -> None:
    proc = subprocess.run(["systemd-analyze", "verify", f"--root={systemd_root}", "--man=no", instance],
                          capture_output=True, text=True, timeout=30)
    # verify exits 0 on unknown keys and bad values, only warning: any output is a failure here
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


@needs_systemd_analyze
@pytest.mark.parametrize(("instance", "threshold"), [("paramserver@ps1.service", 20), ("paramworker.service", 25)])
def test_systemd_security_exposure_is_low(systemd_root: Path, instance: str, threshold: int) -> None:
    """``systemd-analyze security``: 0 is fully locked down, 10 unprotected; the server must stay <= 2.0, the
    worker (GPU devices, JIT code) <= 2.5."""
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={systemd_root}", f"--threshold={threshold}",
                           "--no-pager", instance], capture_output=True, text=True, timeout=30)
    if "Unknown option" in proc.stderr or "unrecognized option" in proc.stderr:
        pytest.skip(f"this systemd-analyze cannot analyse offline: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


# ---------------------------------------------------------------- Prometheus


def _promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_promtool_checks_the_alert_rules() -> None:
    proc = _promtool("check", "rules", "alerts.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    proc = _promtool("test", "rules", "alerts.test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname:\s*(\w+)", (MONITORING / "alerts.test.yml").read_text()))
    assert {"PdparamsNoLeader", "PdparamsQuorumLost", "PdparamsServerDown", "PdparamsRepairQueueGrowing", "PdparamsDiskAlmostFull",
            "PdparamsWorkerLocalHitRatioLow", "PdparamsRequestsShed", "PdparamsChunksQuarantined", "PdparamsRouterDown",
            "PdparamsRouterNoWorkers"} <= tested


READ_TOKEN_FILE = "/etc/prometheus/pdparams/read.token"  # where the scrape configs read the cluster's read token


@needs_promtool
def test_promtool_checks_the_scrape_configs(tmp_path: Path) -> None:
    # promtool checks that a credentials file exists: the configs are checked with the path on a temporary file
    token = tmp_path / "read.token"
    token.write_text("read-token\n")
    for name in ("prometheus-static.yml", "prometheus-kubernetes.yml", "alerts.yml"):
        text = (MONITORING / name).read_text()
        if name.startswith("prometheus"):
            assert READ_TOKEN_FILE in text, f"{name}: the paramserver job must send the read token"
        (tmp_path / name).write_text(text.replace(READ_TOKEN_FILE, str(token)))
    proc = _promtool("check", "config", "prometheus-static.yml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _promtool("check", "config", "prometheus-kubernetes.yml", cwd=tmp_path)
    if proc.returncode != 0 and "kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        # promtool built without Kubernetes discovery (Debian's): check the rest with a static target instead
        config = yaml.safe_load((tmp_path / "prometheus-kubernetes.yml").read_text())
        for job in config["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
            job["static_configs"] = [{"targets": ["127.0.0.1:9100"]}]
        shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        proc = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scrape_jobs_match_the_alerts_and_the_manifests(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    rules = (MONITORING / "alerts.yml").read_text()
    jobs_in_rules = set(re.findall(r'job="(\w+)"', rules))
    # every job the alerts select on is scraped in both setups (a router alert with no router job never fires)
    expected = {"prometheus-static.yml": {"paramserver", "paramworker", "paramrouter"},
                "prometheus-kubernetes.yml": {"paramserver", "paramworker", "paramrouter"}}
    for name, jobs in expected.items():
        config = yaml.safe_load((MONITORING / name).read_text())
        assert {j["job_name"] for j in config["scrape_configs"]} == jobs, name
        assert config["rule_files"] == ["alerts.yml"]
    assert {"paramserver", "paramworker"} <= jobs_in_rules <= expected["prometheus-kubernetes.yml"]
    config = yaml.safe_load((MONITORING / "prometheus-kubernetes.yml").read_text())
    for job in config["scrape_configs"]:
        keep = next(r for r in job["relabel_configs"]
                    if r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"])
        (workload,) = [doc for (kind, _), doc in k8s.items() if kind in ("StatefulSet", "Deployment")
                       and doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == job["job_name"]]
        assert re.fullmatch(keep["regex"], workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"])
