"""The alert rules and the Grafana dashboard name only what the code exports.

A real one-server cluster (``deploy.local``, ``paramserver serve --metrics-port``) and a real
``paramworker serve`` are started, the live ``/metrics`` of both (and of a router's exporter,
``worker.router.RouterMetrics``, in-process) are scraped, and every metric name
(and every label value a selector matches on) in every expression of ``deploy/monitoring/alerts.yml``
and ``deploy/monitoring/grafana/pdparams.json`` must be among the scraped samples. Names are compared
as Prometheus stores them: a counter's ``_total``, a histogram's ``_bucket`` / ``_sum`` / ``_count``.
The Kubernetes probes' target, the standard gRPC health service, is checked on the same server.
"""
from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, local_cluster

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "pdparams.json"

# Series Prometheus makes itself for every scrape target, not exported by any process.
PROMETHEUS_SYNTHETIC = {"up"}
# Labels Prometheus attaches from the scrape config, not the exporter.
TARGET_LABELS = {"job", "instance"}

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
                 "inf", "nan", "atan2"}


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)


def selectors(expr: str) -> list[Selector]:
    """Every metric selector of a PromQL expression: its name and label matchers (functions, keywords,
    label lists of by/on/..., durations, numbers, strings and Grafana variables are not names)."""
    s = re.sub(r"\$\{?\w+\}?", "1m", expr)  # Grafana variables ($__rate_interval)
    matcher_blocks: dict[str, str] = {}

    def keep_block(m: re.Match[str]) -> str:
        key = f"__SEL{len(matcher_blocks)}__"
        matcher_blocks[key] = m.group(1)
        return f"{{{key}}}"

    s = re.sub(r"\{([^}]*)\}", keep_block, s)
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', s)
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges and subqueries
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    out = []
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)\s*(\(|\{(__SEL\d+__)\})?", s):
        name, follow, block = m.group(1), m.group(2), m.group(3)
        if name.startswith("__SEL"):
            continue
        if follow == "(" or name.lower() in _PROMQL_WORDS:
            continue
        matchers = ()
        if block is not None:
            matchers = tuple((lab, op, val) for lab, op, val in
                             re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"', matcher_blocks[block]))
        out.append(Selector(name, matchers))
    return out


def alert_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return [(rule.get("alert") or rule["record"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))

    walk(dash["panels"])
    return out


# ---------------------------------------------------------------- the extractor itself


def test_selector_extraction_finds_names_and_matchers_only() -> None:
    expr = ('sum by (instance) (increase(pdparams_load_bytes_total{tier=~"memory|disk", job="w"}[1h])) / '
            'sum without (le) (rate(pdparams_infer_seconds_bucket[$__rate_interval])) > 0.85 and on(instance) '
            'up offset 10m or vector(0) * 1e3 < histogram_quantile(0.99, x_sum) unless absent(a:b:c == 1)')
    got = selectors(expr)
    assert [s.metric for s in got] == ["pdparams_load_bytes_total", "pdparams_infer_seconds_bucket", "up", "x_sum", "a:b:c"]
    assert got[0].matchers == (("tier", "=~", "memory|disk"), ("job", "=", "w"))
    assert selectors('count(up{job="paramserver"} == 1) * 2 <= count(up{job="paramserver"})') == [
        Selector("up", (("job", "=", "paramserver"),))] * 2


def test_every_expression_names_a_metric_and_the_dashboard_uses_the_datasource_variable() -> None:
    exprs = alert_expressions() + dashboard_expressions()
    assert len(alert_expressions()) >= 10 and len(dashboard_expressions()) >= 20
    for where, expr in exprs:
        assert selectors(expr), f"{where}: no metric in {expr!r}"
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------- against live processes


@dataclass
class Scrape:
    samples: dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value) of each sample

    @classmethod
    def of(cls, text: str) -> Scrape:
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), s.value))
        return cls(samples)

    def labels(self, name: str) -> list[dict[str, str]]:
        return [labels for labels, _ in self.samples[name]]

    def value(self, name: str) -> float:
        (only,) = self.samples[name]
        return only[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Scrape, Scrape, str]]:
    """(server scrape, worker scrape, server gRPC address) from a running server and worker."""
    import torch

    from paramserver.client.push import push
    from tests.integration.serve_models import slow_net
    from tests.integration.test_serve_cache import Worker

    root = tmp_path_factory.mktemp("monitoring")
    metrics_port = free_port()
    # one server: --metrics-port is the same flag for every server of a deploy.local cluster
    with local_cluster(root / "cluster", servers=1, replication=1,
                       extra_args=("--metrics-port", str(metrics_port), "--no-fsync", "--log-level", "WARNING")) as cluster:
        torch.manual_seed(0)
        push(cluster.seed, slow_net().state_dict(), model="mon", tag="prod")
        worker = Worker(cluster, "mon:prod", "--disk-cache", str(root / "disk-cache"), forward_s=0.0)
        try:
            conn = worker.connection()
            conn.request("POST", "/infer", body=json.dumps({"input": [[1.0, 2.0, 3.0, 4.0]]}).encode(),
                         headers={"Content-Type": "application/json"})
            assert conn.getresponse().status == 200
            conn.close()
            host = cluster.seed.split(",")[0].rpartition(":")[0]
            server = Scrape.of(_get(f"http://{host}:{metrics_port}/metrics"))
            scraped = Scrape.of(worker.get("/metrics").decode())
            yield server, scraped, cluster.seed.split(",")[0]
        finally:
            worker.stop()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_every_alert_and_dashboard_expression_names_only_exported_metrics(live: tuple[Scrape, Scrape, str]) -> None:
    from worker.router import Router, RouterOptions

    server, worker, _ = live
    router = Scrape.of(Router(RouterOptions()).metrics.render().decode())  # what paramrouter's GET /metrics serves
    exported = {**server.samples, **worker.samples, **router.samples}
    assert "paramserver_is_leader" in server.samples and "pdparams_infer_requests_total" in worker.samples
    assert "pdparams_router_workers" in router.samples
    problems = []
    for where, expr in alert_expressions() + dashboard_expressions():
        for sel in selectors(expr):
            if sel.metric in PROMETHEUS_SYNTHETIC:
                continue
            if sel.metric not in exported:
                problems.append(f"{where}: {sel.metric} is not exported")
                continue
            for label, op, value in sel.matchers:
                if label in TARGET_LABELS or op not in ("=", "=~"):
                    continue
                seen = {labels.get(label) for labels, _ in exported[sel.metric]}
                wanted = value.split("|") if op == "=~" else [value]
                missing = [w for w in wanted if w not in seen]
                if missing:
                    problems.append(f"{where}: {sel.metric}{{{label}{op}{value!r}}}: no sample with {label} in {missing} "
                                    f"(seen: {sorted(v for v in seen if v is not None)})")
    assert not problems, "\n".join(problems)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_server_exports_disk_usage_and_quorum_with_sane_values(live: tuple[Scrape, Scrape, str]) -> None:
    server, worker, _ = live
    for name in ("paramserver_disk_free_bytes", "paramserver_disk_capacity_bytes", "paramserver_raft_has_quorum"):
        assert server.labels(name) == [{"server": "ps1"}], name
    assert 0 < server.value("paramserver_disk_free_bytes") <= server.value("paramserver_disk_capacity_bytes")
    # a one-server cluster is its own majority and its leader
    assert server.value("paramserver_raft_has_quorum") == 1.0 and server.value("paramserver_is_leader") == 1.0
    assert {labels["tier"] for labels in worker.labels("pdparams_load_bytes_total")} == {"memory", "disk", "network", "peer"}
    assert "shed" in {labels["outcome"] for labels in worker.labels("pdparams_infer_requests_total")}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_kubernetes_probe_target_grpc_health_answers_serving(live: tuple[Scrape, Scrape, str]) -> None:
    """deploy/k8s probes the server with Kubernetes' native gRPC probe: grpc.health.v1.Health/Check, service ""."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, _, address = live
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
