"""Rendered = runnable: the CPU values of the chart, started as local processes, serve a chat.

No cluster needed. The chart is rendered with values-cpu.yaml (ports moved to free ones and the
listen address to loopback, as values an operator could set). Every Deployment's container is then
started the way the kubelet would start it: the image's entrypoint with the rendered args, the
environment from the rendered env/envFrom (fieldRefs resolved for a pod at 127.0.0.1, $(VAR)
expanded), volume mount paths mapped to local directories (the model volume to a tiny checkpoint).
Kubernetes discovery is the one thing a laptop lacks: the router's selectors name the pools'
headless Services, and each Service name is mapped to 127.0.0.1 on the Service's port (static
discovery), which is what the EndpointSlices of one-pod pools would say.

The processes must come up, the router's rendered readiness probe must pass, a chat completion
must succeed, and on SIGTERM every process must exit cleanly within its pod's grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from helm_chart import (CHART, NAMESPACE, REPO, container, container_env, expand_refs, find, flag, one,
                        render_values)
from ports import free_ports

pytestmark = pytest.mark.slow


def image_entrypoint(dockerfile: Path) -> list[str]:
    (line,) = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    return json.loads(line.split(None, 1)[1])


def rendered_cpu_deployment() -> tuple[list[dict], dict]:
    values = yaml.safe_load((CHART / "values-cpu.yaml").read_text())
    http, grpc_port, prefill, decode = free_ports(4)
    values["listenHost"] = "127.0.0.1"
    values.setdefault("router", {}).update(httpPort=http, grpcPort=grpc_port)
    values.setdefault("prefill", {})["port"] = prefill
    values.setdefault("decode", {})["port"] = decode
    return render_values(values)


def local_discovery(docs: list[dict], args: list[str]) -> list[str]:
    """Replace the router's kubernetes discovery flags with the pools' Services mapped to 127.0.0.1."""
    assert flag(args, "--discovery") == "kubernetes"
    port_name = flag(args, "--k8s-port-name")
    addresses = {}
    for role in ("prefill", "decode"):
        key, _, service_name = flag(args, f"--k8s-{role}-selector").partition("=")
        assert key == "kubernetes.io/service-name"
        service = one(docs, "Service", service_name)
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
        addresses[role] = f"127.0.0.1:{port['port']}"
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a.startswith("--k8s-") or a == "--discovery":
            skip = 1
            continue
        out.append(a)
    return out + ["--discovery", "static", "--prefill", addresses["prefill"], "--decode", addresses["decode"]]


class Pod:
    """One Deployment's container, run as a local process group."""

    def __init__(self, docs, deployment, tmp: Path, model_dir: Path):
        self.name = deployment["metadata"]["name"]
        assert deployment["spec"].get("replicas", 1) == 1, "one pod per Deployment on one host"
        pod = deployment["spec"]["template"]["spec"]
        self.grace_s = pod["terminationGracePeriodSeconds"]
        self.container = c = container(deployment)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {}
        for m in c.get("volumeMounts", []):
            local = tmp / self.name / m["name"]
            if "persistentVolumeClaim" in volumes[m["name"]] or "hostPath" in volumes[m["name"]]:
                local = model_dir  # the only external volume is the model
            local.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = str(local)
        fields = {"metadata.name": f"{self.name}-0", "metadata.namespace": NAMESPACE,
                  "status.podIP": "127.0.0.1"}
        env = {k: self._map(v, mounts) for k, v in container_env(docs, c, fields).items()}
        args = [self._map(expand_refs(a, env), mounts) for a in c["args"]]
        if args[0] == "router":
            args = local_discovery(docs, args)
        entrypoint = image_entrypoint(REPO / "docker" / "Dockerfile.cpu")
        assert entrypoint[-1] == "pdserve", entrypoint  # an init (tini) may come first
        self.argv = [sys.executable, "-m", "pdserve.launch.cli", *args]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        self.log = tmp / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def _map(text: str, mounts: dict[str, str]) -> str:
        for path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if text == path or text.startswith(path + "/"):
                return local + text[len(path):]
        return text

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-25:])

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_rendered_cpu_chart_runs_as_processes_and_serves_a_chat(tmp_path, tiny_mxfp4):
    docs, values = rendered_cpu_deployment()
    deployments = find(docs, "Deployment")
    pods = {d["metadata"]["labels"]["app.kubernetes.io/component"]: Pod(docs, d, tmp_path, tiny_mxfp4)
            for d in deployments}
    assert set(pods) == {"router", "prefill", "decode"}
    router = pods["router"].container
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    readiness = router["readinessProbe"]["httpGet"]
    base = f"http://127.0.0.1:{ports[readiness['port']]}"
    try:
        for pod in pods.values():
            pod.start()
        deadline = time.monotonic() + 180
        while True:
            for pod in pods.values():
                if pod.proc.poll() is not None:
                    pytest.fail(f"{pod.name} exited with {pod.proc.returncode}:\n{pod.tail()}")
            try:
                if httpx.get(base + readiness["path"], timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("router never ready:\n" + "\n".join(p.tail() for p in pods.values()))
            time.sleep(0.3)
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": values["model"]["servedModelName"], "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == values["model"]["servedModelName"]
        assert body["usage"]["completion_tokens"] >= 1
        # each worker timed its KV transfer path at start; the router exports what they measured
        selftests = [line for line in httpx.get(base + "/metrics").text.splitlines()
                     if line.startswith("pdserve_worker_kv_selftest_bytes_per_second{")]
        assert len(selftests) == 2 and all(float(line.split()[-1]) > 0 for line in selftests), selftests
        for pod in pods.values():
            pod.terminate()
        for pod in pods.values():
            try:
                code = pod.proc.wait(timeout=pod.grace_s)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{pod.name} still running {pod.grace_s}s after SIGTERM:\n{pod.tail()}")
            assert code == 0, f"{pod.name} exited with {code}:\n{pod.tail()}"
    finally:
        for pod in pods.values():
            pod.kill()
