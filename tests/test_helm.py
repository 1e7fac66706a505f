"""The Helm chart: lint, render and validate every manifest against Kubernetes' own schemas, then
check the properties the deployment relies on (RBAC scope, network isolation, GPUs per replica,
probes, discovery wiring between the router's flags and the pools' headless Services).

Rendering uses helm-python-sdk (Helm's Go SDK behind ctypes, no helm binary); validation uses the
OpenAPI-derived JSON schemas that kubernetes-validate ships, in strict mode (unknown fields fail).
"""

from __future__ import annotations

import json

import helm_python as helm
import kubernetes_validate
import pytest

from helm_chart import (ALL_FEATURES, CHART, FULLNAME, KUBE_VERSION, NAMESPACE, NO_SCHEMA_KINDS, RELEASE,
                        VALUES_FILES, container, container_env, expand_refs, find, flag, one, pod_containers,
                        render, render_values, user_values)

ALL_CONFIGS = [*VALUES_FILES, "all-features", "static", "keda-gang"]


# -- lint and schema validation --------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_lint_is_clean(name):
    report = helm.lint(str(CHART), user_values(name), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_manifest_validates_against_kubernetes_schemas(name):
    docs, _ = render(name)
    assert docs
    skipped = set()
    for doc in docs:
        if doc["kind"] in NO_SCHEMA_KINDS:
            skipped.add(doc["kind"])
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}")
        assert doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE
    expected = {"all-features": {"ServiceMonitor"},
                "keda-gang": {"ServiceMonitor", "ScaledObject", "PodGroup"}}.get(name, set())
    assert skipped == expected  # CRDs without a schema here; each is checked by its own test


def test_optional_resources_are_off_by_default_and_render_when_enabled():
    default, _ = render("default")
    assert not find(default, "HorizontalPodAutoscaler") and not find(default, "ServiceMonitor")
    docs, _ = render("all-features")
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in find(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {f"{FULLNAME}-router", f"{FULLNAME}-decode"}
    assert hpas[f"{FULLNAME}-decode"]["spec"]["metrics"] == ALL_FEATURES["decode"]["autoscaling"]["metrics"]
    # an autoscaled Deployment must not pin replicas (Helm would fight the HPA on every upgrade)
    for name in hpas:
        assert "replicas" not in one(docs, "Deployment", name)["spec"]
    monitor = one(docs, "ServiceMonitor", f"{FULLNAME}-router")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics",
                                             "interval": "15s", "scrapeTimeout": "10s",
                                             "scheme": "https",  # router.tls is on here
                                             "tlsConfig": {"insecureSkipVerify": True}}]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    router_service = one(docs, "Service", f"{FULLNAME}-router")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= router_service["metadata"]["labels"].items()
    # engine files: a ConfigMap mounted in every pdserve container
    one(docs, "ConfigMap", f"{FULLNAME}-engine-files")
    for deployment in find(docs, "Deployment"):
        mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
        assert mounts["engine-files"]["mountPath"] == "/etc/pdserve"


# -- values schema and template checks -----------------------------------------------------------

@pytest.mark.parametrize("values, message", [
    ({"routr": {"replicas": 2}}, "additional properties 'routr' not allowed"),
    ({"prefill": {"resurces": {}}}, "additional properties 'resurces' not allowed"),
    ({"decode": {"tp": 3}}, "/decode/tp"),
    ({"decode": {"replicas": "2"}}, "got string, want integer"),
    ({"device": "rocm"}, "/device"),
    ({"engine": {"env": {"LOG_LEVEL": "debug"}}}, "PDSERVE_"),
    ({"router": {"probes": {"readiness": {"periodSecond": 5}}}}, "periodSecond"),
])
def test_schema_rejects_typos_and_wrong_types(values, message):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError, match=message):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values, message", [
    ({"decode": {"tp": 2, "ep": 4}}, "decode.ep \\(4\\) must divide decode.tp \\(2\\)"),
    ({"router": {"discovery": "static"}}, "router.staticWorkers"),
    ({"model": {"volume": {"type": "pvc", "claimName": ""}}}, "claimName is required"),
    ({"model": {"volume": {"type": "hostPath"}}}, "hostPath is required"),
    ({"decode": {"autoscaling": {"enabled": True}}}, "decode.autoscaling.metrics"),
    ({"decode": {"terminationGracePeriodSeconds": 10}}, "must exceed workers.preStopSleepSeconds"),
])
def test_inconsistent_values_fail_with_a_message(values, message):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmRenderError, match=message):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


# -- properties the deployment relies on -----------------------------------------------------------

@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_router_rbac_is_read_only_discovery_in_its_namespace(name):
    docs, values = render(name)
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    router = one(docs, "Deployment", f"{FULLNAME}-router")
    pod = router["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    one(docs, "ServiceAccount", account)
    if values["router"]["discovery"] != "kubernetes":
        assert not find(docs, "Role") and not find(docs, "RoleBinding")
        assert pod["automountServiceAccountToken"] is False
        return
    assert pod["automountServiceAccountToken"] is True
    (role,) = find(docs, "Role")
    rules = sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])))
                   for r in role["rules"])
    # exactly what router/discovery_k8s.py reads: EndpointSlices (list + watch), nothing else
    assert rules == [(("discovery.k8s.io",), ("endpointslices",), ("list", "watch"))]
    assert not any(r.get("resourceNames") for r in role["rules"])
    (binding,) = find(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": NAMESPACE}]
    # the workers get no API access at all
    for pool in ("prefill", "decode"):
        worker_pod = one(docs, "Deployment", f"{FULLNAME}-{pool}")["spec"]["template"]["spec"]
        assert worker_pod["serviceAccountName"] != account
        assert worker_pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_router_discovery_flags_match_the_headless_pool_services(name):
    docs, values = render(name)
    args = container(one(docs, "Deployment", f"{FULLNAME}-router"))["args"]
    assert args[0] == "router"
    assert flag(args, "--discovery") == values["router"]["discovery"]
    assert flag(args, "--port") == str(values["router"]["httpPort"])
    assert flag(args, "--grpc-port") == str(values["router"]["grpcPort"])
    assert flag(args, "--served-model-name") == values["model"]["servedModelName"]
    if values["router"]["discovery"] == "static":
        assert flag(args, "--prefill") == "10.0.0.1:50061"
        assert flag(args, "--decode") == "10.0.0.2:50062,10.0.0.3:50062"
        return
    assert flag(args, "--k8s-namespace") == NAMESPACE
    port_name = flag(args, "--k8s-port-name")
    for pool in ("prefill", "decode"):
        key, _, service_name = flag(args, f"--k8s-{pool}-selector").partition("=")
        assert key == "kubernetes.io/service-name"  # the label every EndpointSlice carries
        service = one(docs, "Service", service_name)
        assert service["spec"]["clusterIP"] == "None"
        assert not service["spec"].get("publishNotReadyAddresses")
        (port,) = service["spec"]["ports"]
        assert port["name"] == port_name and port["port"] == values[pool]["port"]
        deployment = one(docs, "Deployment", f"{FULLNAME}-{pool}")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert {"name": port_name, "containerPort": values[pool]["port"], "protocol": "TCP"} in \
            container(deployment)["ports"]


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_one_pod_per_replica_holds_all_its_gpus(name):
    docs, values = render(name)
    gpu = values["workers"]["gpuResourceName"]
    cuda = values["device"] == "cuda"
    for pool in ("prefill", "decode"):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{pool}")
        pod = deployment["spec"]["template"]["spec"]
        assert not pod.get("initContainers")
        c = container(deployment)
        args = c["args"]
        assert args[0] == f"{pool}-worker"
        assert flag(args, "--device") == values["device"]
        tp = int(flag(args, "--tp"))
        assert tp == values[pool]["tp"]
        resources = c["resources"]
        if cuda:
            # one pod = one replica = all tp GPUs of its TP (and EP) group, on one node
            assert resources["limits"][gpu] == tp and resources["requests"][gpu] == tp
        else:
            assert gpu not in resources.get("limits", {}) and gpu not in resources.get("requests", {})
        if pool == "decode":
            ep = int(flag(args, "--ep"))
            assert ep == values["decode"]["ep"] and tp % ep == 0
            assert int(flag(args, "--max-batch-size")) == values["decode"]["maxBatchSize"]
        rdma = values["workers"]["rdma"]
        expected = {}
        if cuda and rdma["enabled"]:  # per pod, plus per GPU x the pool's GPUs
            expected = dict(rdma["resources"])
            for resource, per_gpu in rdma["resourcesPerGpu"].items():
                expected[resource] = expected.get(resource, 0) + per_gpu * tp
            assert expected, "RDMA on without an RDMA device in the pod"
        extended = {k: v for k, v in resources.get("limits", {}).items()
                    if k not in ("cpu", "memory", gpu)}
        assert extended == expected
        assert {k: v for k, v in resources.get("requests", {}).items()
                if k not in ("cpu", "memory", gpu)} == expected
        capabilities = c["securityContext"]["capabilities"]
        assert capabilities["drop"] == ["ALL"]
        assert capabilities.get("add", []) == (["IPC_LOCK"] if cuda and rdma["enabled"] else [])
        if not capabilities.get("add"):
            assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_gpu_sizing_of_the_example_values_files():
    expected = {  # (prefill tp, decode tp, decode ep) as docs/deploy.md derives them
        "default": (1, 1, 1), "gpt-oss-20b": (1, 2, 2), "gpt-oss-120b": (2, 4, 4),
    }
    for name, (prefill_tp, decode_tp, decode_ep) in expected.items():
        docs, _ = render(name)
        prefill = container(one(docs, "Deployment", f"{FULLNAME}-prefill"))
        decode = container(one(docs, "Deployment", f"{FULLNAME}-decode"))
        assert prefill["resources"]["limits"]["nvidia.com/gpu"] == prefill_tp
        assert decode["resources"]["limits"]["nvidia.com/gpu"] == decode_tp
        assert flag(decode["args"], "--ep") == str(decode_ep)
        for c in (prefill, decode):
            assert c["args"][c["args"].index("--model") + 1].endswith(name.replace("default", "gpt-oss-20b"))


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_worker_pods_shm_model_volume_and_kv_host(name):
    docs, values = render(name)
    for pool in ("prefill", "decode"):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{pool}")
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory",
                                               "sizeLimit": values[pool]["shmSizeLimit"]}
        assert mounts["dshm"]["mountPath"] == "/dev/shm"
        assert mounts["model"]["readOnly"] is True
        assert mounts["model"]["mountPath"] == values["model"]["path"]
        model_volume = volumes["model"]
        if values["model"]["volume"]["type"] == "pvc":
            assert model_volume["persistentVolumeClaim"]["readOnly"] is True
        else:
            assert model_volume["hostPath"]["path"] == values["model"]["volume"]["hostPath"]
        assert flag(c["args"], "--kv-host") == "$(POD_IP)"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["envFrom"] == [{"configMapRef": {"name": f"{FULLNAME}-engine"}}]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_probes(name):
    docs, values = render(name)
    services = {"prefill": "pdserve.v1.PrefillWorker", "decode": "pdserve.v1.DecodeWorker"}
    for pool, service in services.items():
        c = container(one(docs, "Deployment", f"{FULLNAME}-{pool}"))
        port = values[pool]["port"]
        assert c["startupProbe"]["grpc"] == {"port": port, "service": service}
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}
        assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
        startup = c["startupProbe"]
        budget_s = startup["periodSeconds"] * startup["failureThreshold"]
        # weight loading: at least 15 minutes on GPUs (120b reads ~65 GB per replica), 5 on CPU
        assert budget_s >= (900 if values["device"] == "cuda" else 300)
        assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] >= 30
    router = container(one(docs, "Deployment", f"{FULLNAME}-router"))
    scheme = {"scheme": "HTTPS"} if values["router"]["tls"]["enabled"] else {}
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", **scheme}
    # liveness must not depend on workers being up: that would restart every router at once
    assert router["livenessProbe"]["httpGet"]["path"] != "/health"
    assert router["startupProbe"]["httpGet"]["port"] == "http"
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"http": values["router"]["httpPort"], "grpc": values["router"]["grpcPort"]}
    service = one(docs, "Service", f"{FULLNAME}-router")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_network_policy_isolates_worker_ports(name):
    docs, values = render(name)
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}
    workers = one(docs, "NetworkPolicy", f"{FULLNAME}-workers")["spec"]
    assert workers["policyTypes"] == ["Ingress"]
    assert workers["podSelector"]["matchLabels"] == release
    assert workers["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]
    from_router, from_workers = workers["ingress"][:2]
    assert from_router["from"] == [{"podSelector": {"matchLabels": {
        **release, "app.kubernetes.io/component": "router"}}}]
    assert sorted(p["port"] for p in from_router["ports"]) == sorted(
        {values["prefill"]["port"], values["decode"]["port"]})
    assert from_workers["from"] == [{"podSelector": workers["podSelector"]}]
    assert len(workers["ingress"]) == 2 + len(values["networkPolicy"]["extraWorkerIngress"])
    # every peer is a pod selector (no ipBlock / namespaceSelector opening the workers up)
    for rule in workers["ingress"][:2]:
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])
    router = one(docs, "NetworkPolicy", f"{FULLNAME}-router")["spec"]
    rule, *scrape = router["ingress"]
    assert sorted(p["port"] for p in rule["ports"]) == sorted(
        [values["router"]["httpPort"], values["router"]["grpcPort"]])
    assert rule.get("from", []) == values["networkPolicy"]["routerIngressFrom"]
    if values["serviceMonitor"]["enabled"]:  # Prometheus' namespace reaches the HTTP port (/metrics)
        (scrape,) = scrape
        assert scrape == {"ports": [{"port": values["router"]["httpPort"], "protocol": "TCP"}],
                          "from": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": values["serviceMonitor"]["prometheusNamespace"]}}}]}
    else:
        assert not scrape


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_disruption_budgets_and_spread(name):
    docs, values = render(name)
    for component in ("router", "prefill", "decode"):
        pdb = one(docs, "PodDisruptionBudget", f"{FULLNAME}-{component}")
        deployment = one(docs, "Deployment", f"{FULLNAME}-{component}")
        assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
        assert pdb["spec"]["maxUnavailable"] == values[component]["podDisruptionBudget"]["maxUnavailable"]
    for pool in ("prefill", "decode"):
        pod = one(docs, "Deployment", f"{FULLNAME}-{pool}")["spec"]["template"]["spec"]
        spread = values[pool]["spreadReplicas"]
        affinity = pod.get("affinity") or {}
        anti = affinity.get("podAntiAffinity")
        if spread in ("none", "pack"):
            assert anti is None
            if spread == "pack":  # every replica on the node of the others
                (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                assert term["topologyKey"] == "kubernetes.io/hostname"
                assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == pool
            continue
        key = ("requiredDuringSchedulingIgnoredDuringExecution" if spread == "required"
               else "preferredDuringSchedulingIgnoredDuringExecution")
        (term,) = anti[key]
        term = term.get("podAffinityTerm", term)
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == pool


def test_engine_configmap_and_rollout_checksum():
    docs, values = render("default")
    config = one(docs, "ConfigMap", f"{FULLNAME}-engine")
    assert config["data"] == {k: str(v) for k, v in values["engine"]["env"].items()}
    checksums = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/engine"]
                 for d in find(docs, "Deployment")}
    assert len(set(checksums.values())) == 1
    changed, _ = render("all-features")  # different engine settings (files) -> new checksum
    assert container(one(changed, "Deployment", f"{FULLNAME}-router"))  # renders
    other = one(changed, "Deployment", f"{FULLNAME}-decode")["spec"]["template"]["metadata"]
    assert other["annotations"]["checksum/engine"] != checksums[f"{FULLNAME}-decode"]


# -- every rendered command line is one the pdserve CLI accepts -----------------------------------

POD_FIELDS = {"metadata.name": "pod-0", "metadata.namespace": NAMESPACE, "status.podIP": "10.1.2.3"}


def parse_cli(args: list[str]):
    """Parse a container's args with pdserve's own parser (the image's entrypoint is `pdserve`)."""
    import contextlib
    import io

    from pdserve.launch.cli import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`pdserve {' '.join(args)}` is rejected by the CLI: {stderr.getvalue().strip()}")


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_container_command_line_parses_with_the_pdserve_cli(name):
    docs, values = render(name)
    seen = set()
    for workload, c in pod_containers(docs):
        assert "command" not in c, "containers run the image's entrypoint (pdserve under tini)"
        env = container_env(docs, c, POD_FIELDS)
        args = [expand_refs(a, env) for a in c["args"]]
        assert not any("$(" in a for a in args), f"unresolved reference in {args}"
        parsed = parse_cli(args)
        seen.add(parsed.cmd)
        if parsed.cmd.endswith("-worker"):
            assert parsed.model == values["model"]["path"]
            assert parsed.kv_host == POD_FIELDS["status.podIP"]
            assert parsed.device == values["device"]
    assert seen == {"router", "prefill-worker", "decode-worker"}


# -- the sized layouts fit the node shape they state -----------------------------------------------

# An H200 node as the sized values files state it: 8 GPUs, 96 vCPUs, 1,800 GiB (e.g. Azure ND H200
# v5). Of that, 8 vCPUs and 100 GiB are left to the kubelet, the system and the GPU/network
# operators' DaemonSets. Memory limits must fit too (no overcommit: /dev/shm and the page cache of
# the weights count against them).
NODE_GPUS, NODE_CPU, NODE_MEMORY_GIB = 8, 96 - 8, 1800 - 100
NODES = {"default": 1, "gpt-oss-20b": 1, "gpt-oss-120b": 2}


def quantity(text) -> float:
    """Kubernetes quantity -> number (CPUs, or GiB for byte quantities)."""
    units = {"m": 1e-3, "Ki": 2 ** -20, "Mi": 2 ** -10, "Gi": 1, "Ti": 2 ** 10}
    text = str(text)
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def worker_pods(docs, values) -> list[dict]:
    pods = []
    gpu = values["workers"]["gpuResourceName"]
    for pool in ("prefill", "decode"):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{pool}")
        res = container(deployment)["resources"]
        affinity = deployment["spec"]["template"]["spec"].get("affinity") or {}
        pods += [{"pool": pool, "gpus": res["requests"][gpu], "cpu": quantity(res["requests"]["cpu"]),
                  "memory": quantity(res["requests"]["memory"]),
                  "limit": quantity(res["limits"]["memory"]),
                  "pack": "requiredDuringSchedulingIgnoredDuringExecution" in affinity.get("podAffinity", {}),
                  "alone": "requiredDuringSchedulingIgnoredDuringExecution" in affinity.get("podAntiAffinity", {})}
                 ] * deployment["spec"]["replicas"]
    return pods


def fits(node: list[dict], pod: dict) -> bool:
    if sum(p["gpus"] for p in node) + pod["gpus"] > NODE_GPUS:
        return False
    if sum(p["cpu"] for p in node) + pod["cpu"] > NODE_CPU:
        return False
    if max(sum(p["memory"] for p in node) + pod["memory"],
           sum(p["limit"] for p in node) + pod["limit"]) > NODE_MEMORY_GIB:
        return False
    return not (pod["alone"] and any(p["pool"] == pod["pool"] for p in node))


def every_schedule_completes(pending: tuple, nodes: tuple, seen: set) -> str | None:
    """Depth-first over every pod order and every node a scheduler may pick for it (preferred
    rules are not guarantees, so any feasible node); returns a stuck state, or None."""
    if not pending:
        return None
    key = (pending, tuple(sorted(nodes)))
    if key in seen:
        return None
    seen.add(key)
    for i, pod in enumerate(pending):
        if pending.index(pod) != i:
            continue  # identical replicas: one order of them is enough
        pod_d = dict(pod)
        placed_with = [k for k, n in enumerate(nodes) if any(dict(p)["pool"] == pod_d["pool"] for p in n)]
        options = [k for k, n in enumerate(nodes) if fits([dict(p) for p in n], pod_d)]
        if pod_d["pack"] and placed_with:
            options = [k for k in options if k in placed_with]
        if not options:
            return f"{pod_d['pool']} pod has no node; nodes hold {[[dict(p)['pool'] for p in n] for n in nodes]}"
        for k in options:
            nxt = list(nodes)
            nxt[k] = tuple(sorted(nodes[k] + (pod,)))
            stuck = every_schedule_completes(pending[:i] + pending[i + 1:], tuple(nxt), seen)
            if stuck:
                return stuck
    return None


@pytest.mark.parametrize("name", sorted(NODES))
def test_sized_layouts_fit_their_stated_nodes_in_every_placement_order(name):
    docs, values = render(name)
    pods = worker_pods(docs, values)
    for pod in pods:  # a whole replica fits one node
        assert fits([], pod), f"a {pod['pool']} replica does not fit an empty node: {pod}"
    assert sum(p["gpus"] for p in pods) <= NODES[name] * NODE_GPUS
    pending = tuple(sorted(tuple(sorted(p.items())) for p in pods))
    stuck = every_schedule_completes(pending, ((),) * NODES[name], set())
    assert stuck is None, f"{name}: a scheduler can leave a pod Pending: {stuck}"


def test_spread_prefill_replicas_would_leave_120b_pending():
    """The check above catches the layout the chart shipped before: spread TP2 prefill replicas."""
    docs, values = render("gpt-oss-120b")
    pods = worker_pods(docs, values)
    for p in pods:
        if p["pool"] == "prefill":
            p["pack"], p["alone"] = False, True
    pending = tuple(sorted(tuple(sorted(p.items())) for p in pods))
    assert every_schedule_completes(pending, ((), ()), set()) is not None


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_priority_class_and_gang(name):
    docs, values = render(name)
    created = find(docs, "PriorityClass")
    if values["scheduling"]["priorityClass"]["create"]:
        (pc,) = created
        assert pc["metadata"]["name"] == f"{FULLNAME}-{NAMESPACE}" and pc["globalDefault"] is False
        for deployment in find(docs, "Deployment"):
            assert deployment["spec"]["template"]["spec"]["priorityClassName"] == pc["metadata"]["name"]
    else:
        assert not created
    groups = find(docs, "PodGroup")  # gang scheduling is opt-in
    assert len(groups) == (1 if values["scheduling"]["gang"]["enabled"] else 0)


def test_gang_scheduling_puts_every_worker_pod_in_one_pod_group():
    docs, values = render_values({**user_values("gpt-oss-120b"), "scheduling": {"gang": {"enabled": True}}})
    (group,) = find(docs, "PodGroup")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"]["minMember"] == values["prefill"]["replicas"] + values["decode"]["replicas"] == 5
    for pool in ("prefill", "decode"):
        pod = one(docs, "Deployment", f"{FULLNAME}-{pool}")["spec"]["template"]
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == group["metadata"]["name"]
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    router = one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]
    assert "schedulerName" not in router  # routers hold no GPUs: the default scheduler places them


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_worker_transports_caches_and_stop_sequence(name):
    docs, values = render(name)
    rdma = values["device"] == "cuda" and values["workers"]["rdma"]["enabled"]
    jit = values["workers"]["jitCache"]
    for pool in ("prefill", "decode"):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{pool}")
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        env = container_env(docs, c, POD_FIELDS)
        transports = set(env["UCX_TLS"].split(","))
        # pods share neither PID nor IPC namespaces: no cuda_ipc, no shared memory between them
        assert not transports & {"cuda_ipc", "sm", "posix", "sysv", "cma", "all"}
        if rdma:
            assert "rc" in transports and "tcp" not in transports  # no silent fallback to TCP
        else:
            assert "tcp" in transports
        assert env["UCX_PROTO_INFO"] == "y"  # the log names the transport UCX picked per peer
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["jit-cache"] == jit["mountPath"]
        for var in ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "DG_JIT_CACHE_DIR"):
            assert env[var].startswith(jit["mountPath"] + "/")
        volume = {v["name"]: v for v in pod["volumes"]}["jit-cache"]
        assert {"hostPath": "hostPath", "pvc": "persistentVolumeClaim", "emptyDir": "emptyDir"}[jit["type"]] in volume
        # stop: preStop pause (routers see the endpoint go), then SIGTERM and the drain, all
        # inside the grace period
        (sleep, seconds) = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep == "sleep" and int(seconds) == values["workers"]["preStopSleepSeconds"]
        parsed = parse_cli([expand_refs(a, env) for a in c["args"]])
        assert parsed.kv_selftest_mib == values["workers"]["kvSelfTestMiB"] > 0  # RDMA checked at start
        drain = parsed.drain_timeout
        assert 0 < drain and int(seconds) + drain + 5 == pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_router_auth_and_tls_wiring(name):
    docs, values = render(name)
    r = values["router"]
    deployment = one(docs, "Deployment", f"{FULLNAME}-router")
    c = container(deployment)
    parsed = parse_cli(c["args"])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "model" not in volumes  # the router reads no weights (the vocabulary is in the image)
    if r["auth"]["enabled"]:
        directory, _, key = parsed.api_key_file.rpartition("/")
        assert key == r["auth"]["secretKey"]
        assert volumes[mounts[directory]]["secret"]["secretName"] == r["auth"]["existingSecret"]
    else:
        assert parsed.api_key_file is None
    if r["tls"]["enabled"]:
        directory = parsed.tls_cert_file.rpartition("/")[0]
        assert parsed.tls_key_file.rpartition("/")[0] == directory
        assert volumes[mounts[directory]]["secret"]["secretName"] == r["tls"]["secretName"]
    else:
        assert parsed.tls_cert_file is None and parsed.tls_key_file is None
    # a preStop pause (the Service drops the pod), then in-flight requests finish, all inside the
    # pod's grace period
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    (sleep, seconds) = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep" and int(seconds) == r["preStopSleepSeconds"]
    assert 0 < parsed.graceful_shutdown_timeout and int(seconds) + parsed.graceful_shutdown_timeout < grace


@pytest.mark.parametrize("values, message", [
    ({"router": {"service": {"type": "LoadBalancer"}}}, "turn on router.auth"),
    ({"router": {"service": {"type": "NodePort"}}}, "turn on router.auth"),
    ({"router": {"auth": {"enabled": True}}}, "existingSecret"),
    ({"router": {"tls": {"enabled": True}}}, "secretName"),
])
def test_exposure_without_keys_is_refused(values, message):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmRenderError, match=message):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    opened = {"router": {"service": {"type": "LoadBalancer", "allowUnauthenticated": True}}}
    docs, _ = render_values(opened)
    assert one(docs, "Service", f"{FULLNAME}-router")["spec"]["type"] == "LoadBalancer"


def test_keda_scales_decode_on_router_metrics():
    docs, values = render_values({"decode": {"keda": {"enabled": True}}, "serviceMonitor": {"enabled": True}})
    (scaled,) = find(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-decode"
    assert "replicas" not in one(docs, "Deployment", f"{FULLNAME}-decode")["spec"]  # KEDA owns it
    assert not find(docs, "HorizontalPodAutoscaler")
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    series = f'{{namespace="{NAMESPACE}", service="{FULLNAME}-router"}}'
    assert triggers["kv-usage"]["metadata"]["query"] == f"max(pdserve_decode_kv_usage_ratio{series})"
    assert triggers["kv-usage"]["metricType"] == "Value"  # a ratio, not a per-replica amount
    assert triggers["waiting-requests"]["metadata"]["query"] == f"sum(pdserve_admission_queue_requests{series})"
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == \
        values["decode"]["autoscaling"]["behavior"]
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmRenderError, match="fight"):
            chart.render({"decode": {"keda": {"enabled": True}, "autoscaling": {
                "enabled": True, "metrics": ALL_FEATURES["decode"]["autoscaling"]["metrics"]}}},
                name=RELEASE, namespace=NAMESPACE)


def test_grafana_dashboard_configmap():
    docs, _ = render("all-features")
    config_map = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["pdserve.json"])
    titles = " | ".join(p["title"] for p in dashboard["panels"])
    for topic in ("Time to first token", "Time per output token", "KV usage", "KV transfer bandwidth"):
        assert topic in titles
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert all('namespace="$namespace"' in e for e in exprs)
