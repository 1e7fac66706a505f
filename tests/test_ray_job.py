"""The Ray deployment: config checks, the orphan guard, and the whole job on a local Ray head.

The end-to-end test runs the commands of docs/deploy.md ("Ray job"): `ray start --head`,
`ray job submit ... -- python -m pdserve.launch.ray_job --config FILE`, one chat completion through the
router with the `openai` client, `ray job stop`; then it checks that no worker process is left.
On the way it SIGKILLs the decode worker's process and watches the replica come back (actor
restart, Ray discovery leave + join).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from pdserve.launch.ray_job import RayJobConfigError, config_from_dict, load_config
from ports import free_ports

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# ---- config ----------------------------------------------------------------------------------
def test_example_config_maps_to_strict_pack_bundles_and_worker_flags():
    cfg = load_config(REPO / "launch" / "ray_job.example.yaml")
    assert cfg.device == "cuda" and cfg.prefill.replicas == 2 and cfg.decode.replicas == 3
    assert cfg.decode.bundles("cuda") == [{"CPU": 6.0, "GPU": 1}] * 4
    assert cfg.prefill.bundles("cpu") == [{"CPU": 6.0}] * 2
    assert cfg.decode.worker_args() == ["--tp", "4", "--ep", "4", "--max-batch-size", "128",
                                        "--kv-memory-fraction", "0.85"]
    assert cfg.prefill.worker_args() == ["--tp", "2"]
    assert cfg.router.extra_args == ("--default-max-tokens", "4096")


def test_json_config_and_defaults(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"model": "tiny", "device": "cpu", "decode": {"kv_blocks": 64}}))
    cfg = load_config(path)
    assert cfg.decode.kv_blocks == 64 and cfg.prefill.tp == 1 and cfg.namespace == "pdserve"
    assert cfg.prefill.names() == ["prefill-0"] and cfg.decode.names() == ["decode-0"]


@pytest.mark.parametrize("data, message", [
    ({"decode": {"tp": 4, "ep": 3}}, "decode.ep must divide decode.tp"),
    ({"prefill": {"ep": 2}}, "unknown key(s) ['ep'] in prefill"),
    ({"gpus": 8}, "unknown key(s) ['gpus']"),
    ({"prefill": {"replicas": 0}}, "prefill.replicas must be >= 1"),
    ({"decode": {"tp": "4"}}, "decode.tp must be an integer"),
    ({"decode": {"tp": True}}, "decode.tp must be an integer"),
    ({"device": "rocm"}, "device must be one of"),
    ({"router": {"port": 70000}}, "router.port must be a TCP port"),
    ({"namespace": "a b"}, "namespace must be"),
    ({"decode": {"max_batch_size": 2048}}, "decode.max_batch_size must be in [1, 1024]"),
    ({"env": {"A": ["x"]}}, "env must be a mapping of names to strings"),
    ({"router": ["x"]}, "router must be a mapping"),
    ([1, 2], "the config must be a mapping"),
])
def test_bad_config_values_name_the_key(data, message):
    with pytest.raises(RayJobConfigError) as e:
        config_from_dict(data)
    assert message in str(e.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(RayJobConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml")


# ---- Ray discovery (no cluster needed for these) ---------------------------------------------
def test_ray_discovery_is_a_registered_backend_with_checked_options():
    from pdserve.router.discovery import DiscoveryError, make_discovery
    from pdserve.router.discovery_ray import RayDiscovery, worker_role

    d = make_discovery("ray", namespace="pd-a", poll_interval=0.5, address=None)
    assert isinstance(d, RayDiscovery) and d.namespace == "pd-a" and d.poll_interval == 0.5
    with pytest.raises(DiscoveryError, match="ray discovery takes"):
        make_discovery("ray", selector="x")
    with pytest.raises(DiscoveryError, match="must be > 0"):
        make_discovery("ray", poll_interval=0)
    assert [worker_role(n) for n in ("prefill-0", "decode-12", "router", "decode-", "prefill")] == \
        ["prefill", "decode", None, None, None]


def test_ray_discovery_reads_actor_endpoints_strictly():
    from pdserve.router.discovery import WorkerEndpoint
    from pdserve.router.discovery_ray import RayDiscovery

    d = RayDiscovery("pd")
    assert d._endpoint("decode-0", {"role": "decode", "address": "10.0.0.7:50062", "name": "decode-0"}) == \
        WorkerEndpoint("decode", "10.0.0.7:50062", "decode-0")
    assert d._endpoint("decode-0", None) is None  # not serving
    assert d._endpoint("decode-0", {"role": "prefill", "address": "10.0.0.7:1"}) is None  # wrong role
    assert d._endpoint("decode-0", {"role": "decode", "address": "fd00::1:5"}) is None  # unbracketed v6
    assert d._endpoint("decode-0", {"role": "decode"}) is None


# ---- the orphan guard ------------------------------------------------------------------------
def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_guard_kills_the_whole_group_only_once_its_owner_died():
    """A worker's process group (leader + a grandchild) survives while its owner lives and is
    gone within seconds of the owner being SIGKILLed (no Python runs in the owner then)."""
    owner_code = ("import os, subprocess, time; from launch.ray_job import _guard_process_group as guard; "
                  "p = subprocess.Popen(['sh', '-c', 'sleep 300 & sleep 300'], start_new_session=True); "
                  "guard(os.getpid(), p.pid); print(p.pid, flush=True); time.sleep(300)")
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, cwd=REPO, text=True)
    try:
        pgid = int(owner.stdout.readline())
        time.sleep(2.5)  # the guard polls every second: it must leave a live owner's group alone
        assert len(_group_members(pgid)) >= 2
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _group_members(pgid)
    for pid in leftover:  # don't leak them if the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


# ---- the whole job on a local Ray head -------------------------------------------------------
def processes_with(marker: str) -> dict[int, str]:
    """pid -> command line of every live process whose command line contains `marker`."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in text and state != "Z" and int(cmdline.parent.name) != os.getpid():
            found[int(cmdline.parent.name)] = text
    return found


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


def wait_for(what: str, check, timeout: float, on_timeout=lambda: ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:.0f}s\n{on_timeout()}")


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head` as in docs/deploy.md, owned by this test: `--block` keeps it in the
    foreground, so SIGTERM to it stops exactly this cluster (`ray stop` would stop every Ray on
    the machine, other users' included)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_DEDUP_LOGS": "0"}  # every actor's own lines in `ray job logs`, none merged
    env.pop("RAY_ADDRESS", None)
    dashboard, gcs, agent, client = free_ports(4)
    temp_dir = Path(f"/tmp/ray-{uuid.uuid4().hex[:8]}")  # short: Ray's socket paths are limited
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
           f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
           "--num-cpus=4", "--num-gpus=0", "--object-store-memory=200000000", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    log = open(tmp_path / "ray-head.log", "wb")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"

    def jobs_api_up() -> bool:
        if head.poll() is not None:
            raise AssertionError("ray start exited:\n" + (tmp_path / "ray-head.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(address + "/api/jobs/", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for("the Ray head's job API is up", jobs_api_up, 60)
        yield address, env
    finally:
        # What `ray stop --force` does (SIGKILL to Ray's processes), limited to this head's tree.
        tree = descendants(head.pid) | {head.pid}
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        head.wait()
        alive = wait_for_gone(tree, 15)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not alive, f"Ray processes left after stopping the head: {alive}"


def wait_for_gone(pids: set[int], timeout: float) -> set[int]:
    end = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < end:
        alive = {p for p in alive if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}
        time.sleep(0.2)
    return alive


def chat(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(model="gpt-oss", max_tokens=8, temperature=0,
                                         messages=[{"role": "user", "content": "Say hi."}])
    assert out.choices[0].finish_reason in ("stop", "length")
    assert 1 <= out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ray_job_serves_survives_a_worker_crash_and_leaves_no_process(ray_head, tmp_path):
    address, env = ray_head
    namespace = f"pdserve-test-{uuid.uuid4().hex[:8]}"  # also in every worker's --worker-id
    http_port, grpc_port = free_ports(2)
    config = tmp_path / "pdserve-cpu.yaml"
    config.write_text(f"""\
model: tiny
device: cpu
namespace: {namespace}
router: {{host: 127.0.0.1, port: {http_port}, grpc_port: {grpc_port}, discovery_interval_s: 1.0}}
prefill: {{replicas: 1, cpus_per_rank: 1}}
decode: {{replicas: 1, cpus_per_rank: 1, kv_blocks: 512, max_batch_size: 16}}
""")
    url = f"http://127.0.0.1:{http_port}"
    ray = [str(BIN / "ray"), "job"]
    t0 = time.monotonic()

    def phase(what: str) -> None:  # shown with -s, and with the output of a failing test
        print(f"[{time.monotonic() - t0:6.1f}s] {what}", flush=True)

    def job_logs() -> str:
        out = subprocess.run([*ray, "logs", "--address", address, namespace], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=30)
        return out.stdout + out.stderr  # whole: the router's access log fills the tail

    submitted = subprocess.run(
        [*ray, "submit", "--address", address, "--submission-id", namespace, "--no-wait",
         "--working-dir", ".", "--", "python", "-m", "pdserve.launch.ray_job", "--config", str(config)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    phase("submitted")
    stopped = False
    try:
        wait_for("router healthy", lambda: health(url)[0] == 200, 120, job_logs)
        phase("router healthy")
        workers = processes_with(f"--worker-id {namespace}-")
        assert sorted(cmd.split()[3] for cmd in workers.values()) == ["decode-worker", "prefill-worker"]
        chat(url)
        phase("chat completion done")

        # A crash: the decode worker's process dies. Its actor notices, exits, and Ray restarts it
        # with a new worker; discovery drops the old address and picks up the new one.
        (old_decode,) = [pid for pid, cmd in workers.items() if "decode-worker" in cmd]
        os.kill(old_decode, signal.SIGKILL)
        wait_for("decode worker leaves", lambda: health(url)[1].get("workers", {}).get("decode", {})
                 .get("routable") == 0, 30, job_logs)
        phase("decode worker killed and left")
        new_decode = wait_for("decode worker restarted", lambda: [
            pid for pid, cmd in processes_with(f"--worker-id {namespace}-decode-").items()
            if pid != old_decode], 60, job_logs)
        wait_for("router healthy again", lambda: health(url)[0] == 200, 60, job_logs)
        chat(url)
        phase("decode replica restarted, chat completion done")

        alive = processes_with(f"--worker-id {namespace}-")
        alive_before_stop = set(alive)
        decode_now = {pid for pid, cmd in alive.items() if "decode-worker" in cmd}
        assert len(decode_now) == 1 and old_decode not in decode_now, (alive, job_logs())
        if not set(new_decode) <= decode_now:
            # the replica was restarted once more: fine when its actor process was killed from
            # outside (the guard then takes the worker), a bug when the worker exited by itself
            logs = job_logs()
            assert logs.count("[decode-0] worker process exited with code") == 1, logs
        stop = subprocess.run([*ray, "stop", "--address", address, namespace], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        stopped = True
        assert stop.returncode == 0, stop.stdout + stop.stderr
        phase("job stopped")
        left = wait_for_gone(alive_before_stop, 10)
        assert not left, f"worker processes outlived the job: {processes_with(namespace)}"
        assert processes_with(namespace) == {}
        guards = {pid for old in alive_before_stop | {old_decode, *new_decode}
                  for pid in processes_with(f"kill -0 -{old} ")}
        assert not wait_for_gone(guards, 5), "orphan guards outlived their worker process groups"
        assert health(url)[0] == 0  # nothing listens on the router's port any more
        logs = job_logs()
        assert "pdserve: serving gpt-oss at" in logs and "pdserve: stopped" in logs, logs[-6000:]
    finally:
        if not stopped:
            subprocess.run([*ray, "stop", "--address", address, namespace], env=env, cwd=REPO,
                           capture_output=True, timeout=60)


def _node(node_id: str, cpus: float, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"10.0.0.{len(node_id)}",
            "Resources": {"CPU": cpus} if cpus else {"GPU": 8.0}}


def test_router_prefers_the_drivers_node_and_falls_back_to_any_with_room():
    from pdserve.launch.ray_job import router_node

    nodes = [_node("head", 2), _node("gpu-a", 0), _node("cpu-b", 8)]
    assert router_node(nodes, "head", 1) == "head"
    assert router_node(nodes, "head", 4) == "cpu-b"  # the head is too small: elsewhere, no hang
    assert router_node(nodes, "gpu-a", 1) == "head"  # a driver on a node without CPUs
    assert router_node([_node("head", 2, alive=False), _node("cpu-b", 8)], "head", 1) == "cpu-b"


def test_no_node_can_host_the_router_is_an_error_at_once():
    from pdserve.launch.ray_job import DeploymentError, router_node

    nodes = [_node("head", 0), _node("gpu-a", 0)]  # `ray start --head --num-cpus=0`, GPU-only nodes
    with pytest.raises(DeploymentError, match="no node of the Ray cluster can host the router.*num-cpus"):
        router_node(nodes, "head", 1)


def test_router_restart_settings_are_checked():
    cfg = config_from_dict({"router": {"max_restarts": -1, "start_timeout_s": 30}})
    assert cfg.router.max_restarts == -1 and cfg.router.start_timeout_s == 30
    with pytest.raises(RayJobConfigError, match="router.max_restarts"):
        config_from_dict({"router": {"max_restarts": -2}})


@pytest.mark.slow
def test_router_actor_is_restarted_on_another_node_when_its_node_is_lost():
    """Two CPU nodes and a CPU-less head (in one machine, ray.cluster_utils): the router actor, placed
    as the job places it, comes back on the surviving node with fresh ports when its node goes."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdserve.launch.ray_job import RouterActor, router_node

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        first, second = cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace=f"pdserve-{uuid.uuid4().hex[:6]}")
        node = router_node(ray.nodes(), first.node_id, 1)
        router = ray.remote(RouterActor).options(
            num_cpus=1, max_restarts=-1, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
        ).remote(["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--discovery", "ray"], "t", 1.0)
        ray.get(router.wait_ready.remote(60), timeout=120)

        def where():
            return ray.get(router.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()),
                           timeout=10)

        assert where() == first.node_id
        cluster.remove_node(first)
        deadline = time.monotonic() + 60
        while True:
            try:
                endpoint = ray.get(router.endpoint.remote(), timeout=5)
                break
            except ray.exceptions.RayError:
                assert time.monotonic() < deadline, "the router was not restarted elsewhere"
                time.sleep(1)
        assert where() == second.node_id
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint['http_port']}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        ray.shutdown()
        cluster.shutdown()
