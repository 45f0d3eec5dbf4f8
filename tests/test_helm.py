"""The Helm chart, rendered by real Helm v4 (as a library) with its default values and each
example: lint-clean in strict mode, every manifest valid against the Kubernetes 1.34
schemas, equal to its golden file, the values schema strict, and the manifests wired
together (router flags, Services, NetworkPolicies, KEDA) the way the pool design says.

Regenerate the golden files after a deliberate change to the chart:
    TANDEM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_helm.py
"""

from __future__ import annotations

import base64
import difflib
import os
import re
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
from helm_helpers import (
    CHART,
    HELM,
    NAMESPACE,
    NOTES,
    VALUE_SETS,
    Manifest,
    container,
    find,
    flag_values,
    manifests,
    render,
    values,
)

KUBE_VERSION = "1.34.0"
GOLDEN = HELM / "golden"
UPDATE_GOLDEN = os.environ.get("TANDEM_UPDATE_GOLDEN") == "1"
POOLS = ("prefill", "decode")
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
          "app.kubernetes.io/component", "app.kubernetes.io/version")

# kubernetes_validate has no schemas for CRDs, so the three the chart uses are checked
# against these: the fields we set, typed, and nothing else (additionalProperties false).
_LABEL_SELECTOR = {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                   "properties": {"matchLabels": {"type": "object",
                                                  "additionalProperties": {"type": "string"}}}}
_ENDPOINT = {"type": "object", "required": ["port", "path", "interval"],
             "additionalProperties": False,
             "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}


def _crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "additionalProperties": False,
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                           "metadata": {"type": "object", "required": ["name", "labels"]},
                           "spec": spec}}


CRD_SCHEMAS = {
    "ServiceMonitor": _crd("monitoring.coreos.com/v1", "ServiceMonitor", {
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {"selector": _LABEL_SELECTOR,
                       "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}),
    "PodMonitor": _crd("monitoring.coreos.com/v1", "PodMonitor", {
        "type": "object", "required": ["selector", "podMetricsEndpoints"],
        "additionalProperties": False,
        "properties": {"selector": _LABEL_SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "minItems": 1,
                                               "items": _ENDPOINT}}}),
    "ScaledObject": _crd("keda.sh/v1alpha1", "ScaledObject", {
        "type": "object", "additionalProperties": False,
        "required": ["scaleTargetRef", "minReplicaCount", "maxReplicaCount", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object", "required": ["apiVersion", "kind", "name"],
                "additionalProperties": False,
                "properties": {"apiVersion": {"const": "apps/v1"},
                               "kind": {"const": "StatefulSet"}, "name": {"type": "string"}}},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"],
                "additionalProperties": False,
                "properties": {
                    "type": {"const": "prometheus"},
                    "metadata": {  # KEDA reads trigger metadata as strings only
                        "type": "object", "additionalProperties": False,
                        "required": ["serverAddress", "query", "threshold"],
                        "properties": {"serverAddress": {"type": "string"},
                                       "query": {"type": "string"},
                                       "threshold": {"type": "string",
                                                     "pattern": r"^[0-9]+(\.[0-9]+)?$"}}}}}}}}),
}


@pytest.fixture(scope="module", params=VALUE_SETS)
def value_set(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def rendered(value_set: str) -> dict[str, str]:
    return render(values(value_set))


@pytest.fixture(scope="module")
def docs(rendered: dict[str, str]) -> list[Manifest]:
    return manifests(rendered)


@pytest.fixture(scope="module")
def merged(value_set: str) -> dict[str, Any]:
    """The values the release runs with: the chart's defaults under the example's."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.merge_values(values(value_set))


def test_lint_strict_is_clean(value_set: str) -> None:
    report = helm_python.lint(CHART, values(value_set), strict=True,
                              kube_version=f"v{KUBE_VERSION}")
    assert report["messages"] == [] and report["errors"] == []


def test_manifests_match_the_kubernetes_schemas(docs: list[Manifest]) -> None:
    _validate(docs)


def _validate(docs: list[Manifest]) -> None:
    assert docs
    for m in docs:
        if m.kind in CRD_SCHEMAS:
            jsonschema.validate(m.doc, CRD_SCHEMAS[m.kind])
        else:  # strict: unknown fields are errors; an unknown kind raises SchemaNotFoundError
            kubernetes_validate.validate(m.doc, KUBE_VERSION, strict=True)


# Options no example uses, rendered and checked the same way.
OTHER_VALUES = {
    "init-container": {"model": {"source": "initContainer", "name": "/models/m.gguf",
                                 "initContainer": {"image": "busybox:1.36",
                                                   "command": ["sh", "-c", "fetch-it"]}},
                       "image": {"pullSecrets": ["regcred"]}},
    "host-path": {"model": {"source": "hostPath", "name": "/models/llama",
                            "hostPath": {"path": "/srv/models"}}},
    "made-secrets": {"secrets": {"apiKey": "a", "adminToken": "b", "clusterSecret": "c"},
                     "router": {"ingress": {"enabled": True}, "replicas": 2,
                                "planner": {"mode": "load", "advisory": True}},
                     "metrics": {"serviceMonitor": {"enabled": True},
                                 "podMonitor": {"enabled": True},
                                 "labels": {"release": "kps"}},
                     "networkPolicy": {"enabled": True}, "podDisruptionBudget":
                     {"enabled": False}, "decode": {"connector": "ucx"}},
}


@pytest.mark.parametrize("name", OTHER_VALUES)
def test_other_options_render_valid_manifests(name: str) -> None:
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(OTHER_VALUES[name])
    _validate(manifests(render(OTHER_VALUES[name])))


def test_a_model_source_needs_its_location() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="model.pvc.claimName is required"):
        render({"model": {"source": "pvc"}})


def test_the_decode_pool_cannot_be_empty_but_prefill_can() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="decode needs at least one node"):
        render({"decode": {"replicas": 0}})
    args = container(manifests(render({"prefill": {"replicas": 0}})), "Deployment",
                     "tandem-router")["args"]
    assert flag_values(args, "--prefill") == [] and len(flag_values(args, "--decode")) == 1


def test_every_resource_and_pod_is_labelled(docs: list[Manifest]) -> None:
    for m in docs:
        labels = m.doc["metadata"]["labels"]
        assert all(labels.get(k) for k in LABELS), (m.kind, m.name, labels)
        if "template" in m.doc.get("spec", {}):
            pod_labels = m.doc["spec"]["template"]["metadata"]["labels"]
            assert all(pod_labels.get(k) for k in LABELS), (m.kind, m.name)


def _golden_text(rendered: dict[str, str]) -> str:
    """The render as one YAML stream: templates by path, each document under a
    `# Source:` comment, NOTES.txt last as comments."""
    out = []
    for path in sorted(p for p in rendered if p != NOTES):
        for chunk in re.split(r"^---\s*$", rendered[path], flags=re.M):
            if chunk.strip():
                out.append(f"---\n# Source: {path}\n{chunk.strip()}\n")
    notes = [f"# {line}".rstrip() for line in rendered[NOTES].strip().splitlines()]
    out.append(f"---\n# Source: {NOTES}\n" + "\n".join(notes) + "\n")
    return "".join(out)


def test_render_equals_the_golden_file(value_set: str, rendered: dict[str, str]) -> None:
    path = GOLDEN / f"{value_set}.yaml"
    fresh = _golden_text(rendered)
    if UPDATE_GOLDEN:
        path.write_text(fresh)
        return
    old = path.read_text() if path.exists() else ""
    if fresh != old:
        diff = "".join(difflib.unified_diff(old.splitlines(True), fresh.splitlines(True),
                                            f"{path} (committed)", f"{path} (rendered now)"))
        pytest.fail(f"the chart renders differently from {path}:\n{diff}\nIf the change is "
                    "meant, regenerate: TANDEM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest "
                    "tests/test_helm.py", pytrace=False)


def test_golden_files_are_exactly_the_value_sets() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == sorted(VALUE_SETS)


@pytest.mark.parametrize("bad, where", [
    ({"prefill": {"replicas": "two"}}, "replicas"),
    ({"prefill": {"connector": "carrier-pigeon"}}, "connector"),
    ({"decode": {"connector": "ipc"}}, "connector"),  # needs one PID namespace: not in a chart
    ({"decode": {"grpcPort": 70000}}, "grpcPort"),
    ({"decode": {"keda": {"maxReplicas": 0}}}, "maxReplicas"),
    ({"router": {"planner": {"mode": "fast"}}}, "mode"),
    ({"router": {"planner": {"mode": False}}}, "mode"),  # YAML's bare `off`
    ({"model": {"source": "s3"}}, "source"),
    ({"model": {"dtype": "int8"}}, "dtype"),
    ({"redis": {"external": {"url": "localhost:6379"}}}, "url"),
    ({"secrets": {"apiKey": 1234}}, "apiKey"),
    ({"replicas": 3}, "replicas"),  # an unknown top-level key
    ({"prefill": {"replica": 3}}, "replica"),  # a typo
])
def test_the_values_schema_rejects(bad: dict[str, Any], where: str) -> None:
    with helm_python.Chart.load(CHART) as chart, pytest.raises(helm_python.HelmValuesError,
                                                               match=where):
        chart.validate_schema(bad)


def test_the_values_schema_accepts_the_examples(value_set: str) -> None:
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(values(value_set))


# Pool sizes the router is given per value set: replicas, or keda.maxReplicas under KEDA.
ROUTER_POOL_SIZES = {"default": (1, 1), "cpu-small": (1, 1), "gpu-1p1d": (1, 1),
                     "gpu-2p4d-keda": (4, 8)}


def _address(pool: str, i: int, port: int = 50051) -> str:
    return f"tandem-{pool}-{i}.tandem-{pool}.{NAMESPACE}.svc.cluster.local:{port}"


def test_the_router_is_given_every_ordinal_of_each_pool(value_set: str, docs: list[Manifest],
                                                        merged: dict[str, Any]) -> None:
    args = container(docs, "Deployment", "tandem-router")["args"]
    for pool, n in zip(POOLS, ROUTER_POOL_SIZES[value_set]):
        assert flag_values(args, f"--{pool}") == [_address(pool, i) for i in range(n)]
        sts = find(docs, "StatefulSet", f"tandem-{pool}")
        keda = merged[pool]["keda"]["enabled"]
        # Under KEDA the StatefulSet leaves its size to the ScaledObject.
        assert sts["spec"].get("replicas") == (None if keda else merged[pool]["replicas"])
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == f"tandem-{pool}"


def test_scaling_a_pool_by_upgrade_lists_the_new_pods() -> None:
    docs = manifests(render({"decode": {"replicas": 3, "grpcPort": 6000}}))
    args = container(docs, "Deployment", "tandem-router")["args"]
    assert flag_values(args, "--decode") == [_address("decode", i, 6000) for i in range(3)]
    assert flag_values(args, "--prefill") == [_address("prefill", 0)]
    assert find(docs, "StatefulSet", "tandem-decode")["spec"]["replicas"] == 3


def test_pool_services_are_headless_and_publish_unready_pods(docs: list[Manifest]) -> None:
    for pool in POOLS:
        svc = find(docs, "Service", f"tandem-{pool}")["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_service_selects_one_workload_by_named_ports(docs: list[Manifest]) -> None:
    pods = [(m.name, m.doc["spec"]["template"]) for m in docs if "template" in m.doc["spec"]]
    for svc in (m.doc for m in docs if m.kind == "Service"):
        [(_, pod)] = [(n, t) for n, t in pods
                      if _selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


def test_the_grace_period_outlasts_the_drain(docs: list[Manifest]) -> None:
    for pool in POOLS:
        pod = find(docs, "StatefulSet", f"tandem-{pool}")["spec"]["template"]["spec"]
        [drain] = flag_values(pod["containers"][0]["args"], "--drain-timeout")
        assert pod["terminationGracePeriodSeconds"] > float(drain)
    pod = find(manifests(render({"prefill": {"drainTimeoutSeconds": 120}})),
               "StatefulSet", "tandem-prefill")["spec"]["template"]["spec"]
    assert flag_values(pod["containers"][0]["args"], "--drain-timeout") == ["120"]
    assert pod["terminationGracePeriodSeconds"] == 135


def _secret_env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]
            if e["name"].startswith("TANDEM_")}


def test_secrets_come_from_the_existing_secret() -> None:
    docs = manifests(render(values("gpu-1p1d")))
    assert not [m for m in docs if m.kind == "Secret"]
    ref = {"name": "tandem-secrets", "optional": True}
    assert _secret_env(container(docs, "Deployment", "tandem-router")) == {
        "TANDEM_API_KEY": {**ref, "key": "api-key"},
        "TANDEM_ADMIN_TOKEN": {**ref, "key": "admin-token"},
        "TANDEM_CLUSTER_SECRET": {**ref, "key": "cluster-secret"}}
    for pool in POOLS:
        assert _secret_env(container(docs, "StatefulSet", f"tandem-{pool}")) == {
            "TANDEM_CLUSTER_SECRET": {**ref, "key": "cluster-secret"}}


def test_given_secrets_are_made_and_the_rest_warned_about() -> None:
    rendered = render({"secrets": {"apiKey": "k-123", "clusterSecret": "c-456"}})
    docs = manifests(rendered)
    secret = find(docs, "Secret", "tandem")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "api-key": "k-123", "cluster-secret": "c-456"}
    assert _secret_env(container(docs, "Deployment", "tandem-router")) == {
        "TANDEM_API_KEY": {"name": "tandem", "key": "api-key"},
        "TANDEM_CLUSTER_SECRET": {"name": "tandem", "key": "cluster-secret"}}
    # Pods restart when the Secret changes.
    checksum = find(docs, "Deployment", "tandem-router")["spec"]["template"]["metadata"][
        "annotations"]["checksum/secret"]
    assert re.fullmatch("[0-9a-f]{64}", checksum)
    notes = rendered[NOTES]
    assert "secrets.adminToken is empty: the admin API is closed" in notes
    assert "apiKey is empty" not in notes and "clusterSecret is empty" not in notes


def test_without_secrets_no_env_is_set_and_notes_warn() -> None:
    rendered = render({})
    docs = manifests(rendered)
    assert not [m for m in docs if m.kind == "Secret"]
    for c in [container(docs, "Deployment", "tandem-router"),
              *[container(docs, "StatefulSet", f"tandem-{p}") for p in POOLS]]:
        assert _secret_env(c) == {}
    assert "WARNING: no secrets are set. The API is open" in rendered[NOTES]


def _peer_components(rule: dict[str, Any]) -> set[str]:
    [peer] = rule["from"]
    sel = peer["podSelector"]
    assert sel["matchLabels"] == {"app.kubernetes.io/name": "tandem",
                                  "app.kubernetes.io/instance": "tandem"}
    [expr] = sel["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
    return set(expr["values"])


def test_network_policies_keep_node_and_redis_ports_to_the_release() -> None:
    docs = manifests(render(values("gpu-2p4d-keda")))
    policies = {m.name: m.doc["spec"] for m in docs if m.kind == "NetworkPolicy"}
    assert sorted(policies) == ["tandem-decode", "tandem-prefill", "tandem-redis",
                                "tandem-router"]
    # The router's port is open to anyone.
    assert policies["tandem-router"]["ingress"] == [{"ports": [{"port": "http"}]}]
    for pool in POOLS:
        spec = policies[f"tandem-{pool}"]
        first, nodes_only = spec["ingress"]  # the nccl connector: its own ports too
        assert _peer_components(first) == {"router", "prefill", "decode"}
        assert first["ports"] == [{"port": "grpc"}, {"port": "transfer"},
                                  {"port": "nccl-store"}]
        assert _peer_components(nodes_only) == {"prefill", "decode"}
        assert "ports" not in nodes_only
    [redis] = policies["tandem-redis"]["ingress"]
    assert _peer_components(redis) == {"router", "prefill", "decode"}
    assert redis["ports"] == [{"port": "redis"}]
    # Each policy selects its pods, and names ports those pods have.
    for spec in policies.values():
        [pod] = [m.doc["spec"]["template"] for m in docs if "template" in m.doc["spec"]
                 and _selects(spec["podSelector"]["matchLabels"],
                              m.doc["spec"]["template"]["metadata"]["labels"])]
        names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {p["port"] for rule in spec["ingress"] for p in rule.get("ports", [])} <= names


def test_a_tcp_pool_opens_only_its_two_ports() -> None:
    docs = manifests(render({"networkPolicy": {"enabled": True}}))
    [rule] = find(docs, "NetworkPolicy", "tandem-decode")["spec"]["ingress"]
    assert rule["ports"] == [{"port": "grpc"}, {"port": "transfer"}]


def _promql_regex(query: str) -> str:
    """The regex of the query's one `node=~"..."` matcher, unescaped as PromQL does."""
    [quoted] = re.findall(r'node=~"((?:[^"\\]|\\.)*)"', query)
    return re.sub(r"\\(.)", r"\1", quoted)


def test_keda_scales_each_pool_on_its_own_queue() -> None:
    docs = manifests(render(values("gpu-2p4d-keda")))
    router_args = container(docs, "Deployment", "tandem-router")["args"]
    for pool, other, lo, hi in [("prefill", "decode", 2, 4), ("decode", "prefill", 4, 8)]:
        spec = find(docs, "ScaledObject", f"tandem-{pool}")["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                          "name": f"tandem-{pool}"}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (lo, hi)
        [trigger] = spec["triggers"]
        query = trigger["metadata"]["query"]
        assert query.startswith("sum(max by (node) (tandem:num_requests_waiting{")
        regex = _promql_regex(query)
        # The router labels a node "<role>@<address>" (router/pool.py), and the role may
        # have been switched by the planner: the pool is known by the pod's name.
        for address in flag_values(router_args, f"--{pool}"):
            for role in ("prefill", "decode", "node"):
                assert re.fullmatch(regex, f"{role}@{address}")
        for address in flag_values(router_args, f"--{other}"):
            assert not re.fullmatch(regex, f"{pool}@{address}")
        assert not re.fullmatch(regex, f"{pool}@tandem-{pool}-0Xtandem-{pool}:50051")


def test_keda_bounds_must_be_ordered() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="minReplicas is more than"):
        render({"decode": {"keda": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}})


def test_every_tandem_pod_mounts_the_model_read_only() -> None:
    docs = manifests(render(values("gpu-1p1d")))
    workloads = [("Deployment", "tandem-router"), ("StatefulSet", "tandem-prefill"),
                 ("StatefulSet", "tandem-decode")]
    for kind, name in workloads:
        pod = find(docs, kind, name)["spec"]["template"]["spec"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-3-8b",
                                                           "readOnly": True}} in pod["volumes"]
        c = pod["containers"][0]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert flag_values(c["args"], "--model") == ["/models/Meta-Llama-3-8B-Instruct"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["securityContext"]["runAsUser"] == 10001


def _index_flags(docs: list[Manifest]) -> list[list[str]]:
    return [flag_values(container(docs, kind, name)["args"], "--index")
            for kind, name in [("Deployment", "tandem-router"), ("StatefulSet", "tandem-prefill"),
                               ("StatefulSet", "tandem-decode")]]


def test_the_router_and_nodes_share_one_redis() -> None:
    docs = manifests(render({}))
    assert _index_flags(docs) == [["redis://tandem-redis:6379/0"]] * 3
    find(docs, "Service", "tandem-redis")
    assert container(docs, "Deployment", "tandem-redis")["args"] == [
        "redis-server", "--save", "", "--appendonly", "no", "--protected-mode", "no"]
    docs = manifests(render({"redis": {"enabled": False,
                                       "external": {"url": "rediss://cache:6380/2"}}}))
    assert _index_flags(docs) == [["rediss://cache:6380/2"]] * 3
    assert not [m for m in docs if m.name == "tandem-redis"]
    docs = manifests(render({"redis": {"enabled": False}}))
    assert _index_flags(docs) == [[]] * 3  # each router follows the nodes' events itself
