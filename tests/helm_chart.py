"""Rendering the Helm chart in tests: helm-python-sdk (Helm's Go SDK behind ctypes, no helm binary)
renders with the chart's own defaults merged, and small lookups find manifests and flags."""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "pdserve"
RELEASE, NAMESPACE = "pd", "serving"
FULLNAME = "pd-pdserve"
KUBE_VERSION = kubernetes_validate.utils.latest_version()  # newest schema set it ships
# CRDs kubernetes-validate has no schema for; each is checked by hand below.
NO_SCHEMA_KINDS = {"ServiceMonitor", "ScaledObject", "PodGroup"}

VALUES_FILES = {
    "default": None,
    "cpu": "values-cpu.yaml",
    "gpt-oss-20b": "values-gpt-oss-20b.yaml",
    "gpt-oss-120b": "values-gpt-oss-120b.yaml",
}
# Every optional template switched on, on top of the default values.
ALL_FEATURES = {
    "router": {"autoscaling": {"enabled": True}, "service": {"type": "LoadBalancer"},
               "auth": {"enabled": True, "existingSecret": "pd-api-keys"},
               "tls": {"enabled": True, "secretName": "pd-router-tls"}},
    "decode": {"autoscaling": {"enabled": True, "metrics": [{
        "type": "Object",
        "object": {"metric": {"name": "pdserve_decode_kv_usage_ratio"},
                   "describedObject": {"apiVersion": "v1", "kind": "Service",
                                       "name": f"{FULLNAME}-router"},
                   "target": {"type": "Value", "value": "800m"}}}]}},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True},
    "engine": {"files": {"engine.yaml": "max_model_len: 131072\n"}},
    "networkPolicy": {"routerIngressFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "ingress-nginx"}}}]},
    "workers": {"podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
                "env": {"UCX_NET_DEVICES": "mlx5_0:1"}},
}


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def user_values(name: str) -> dict:
    if name == "all-features":
        return copy.deepcopy(ALL_FEATURES)
    if name == "keda-gang":  # the 120b layout autoscaled by KEDA and gang-scheduled
        return deep_merge(user_values("gpt-oss-120b"), {
            "decode": {"keda": {"enabled": True}}, "serviceMonitor": {"enabled": True},
            "scheduling": {"gang": {"enabled": True}}})
    if name == "static":
        return {"router": {"discovery": "static",
                           "staticWorkers": {"prefill": ["10.0.0.1:50061"],
                                             "decode": ["10.0.0.2:50062", "10.0.0.3:50062"]}}}
    file = VALUES_FILES[name]
    return yaml.safe_load((CHART / file).read_text()) if file else {}


def render_values(values: dict) -> tuple[list[dict], dict]:
    """Render the chart with `values` over its defaults: (manifests, the merged values)."""
    with helm.Chart.load(str(CHART)) as chart:
        merged = chart.merge_values(values)
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [doc for path, text in sorted(manifests.items()) if path.endswith((".yaml", ".yml"))
            for doc in yaml.safe_load_all(text) if doc]
    return docs, merged


@functools.cache
def _rendered(name: str) -> tuple[str, str]:
    docs, merged = render_values(user_values(name))
    return json.dumps(docs), json.dumps(merged)


def render(name: str) -> tuple[list[dict], dict]:
    """(manifests, the values Helm used after merging the chart's defaults) of a named config."""
    docs, merged = _rendered(name)
    return json.loads(docs), json.loads(merged)


def find(docs, kind, name=None):
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return hits


def one(docs, kind, name):
    hits = find(docs, kind, name)
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def container(deployment):
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args, name):
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]




def pod_containers(docs) -> list[tuple[dict, dict]]:
    """(workload, container) for every container of every pod template in the manifests."""
    out = []
    for doc in docs:
        spec = doc.get("spec", {})
        for template in _pod_templates(doc["kind"], spec):
            for c in template["spec"].get("containers", []) + template["spec"].get("initContainers", []):
                out.append((doc, c))
    return out


def _pod_templates(kind: str, spec: dict) -> list[dict]:
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [spec["template"]]
    if kind == "LeaderWorkerSet":
        lws = spec["leaderWorkerTemplate"]
        return [t for t in (lws.get("leaderTemplate"), lws["workerTemplate"]) if t]
    return []


def container_env(docs, c: dict, field_values: dict[str, str]) -> dict[str, str]:
    """The environment Kubernetes gives container `c`: envFrom ConfigMaps of the release, then env
    (later wins), fieldRefs resolved from `field_values` (e.g. {"status.podIP": "127.0.0.1"}),
    $(VAR) references expanded as the kubelet does."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        config_map = one(docs, "ConfigMap", source["configMapRef"]["name"])
        env.update({k: str(v) for k, v in (config_map.get("data") or {}).items()})
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = expand_refs(item["value"], env)
        else:
            env[item["name"]] = field_values[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand_refs(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values (unknown references stay as written)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)
