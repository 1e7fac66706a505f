"""Metrics the chart's autoscalers and dashboard read exist, with the values they claim."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml

from helm_chart import CHART, render_values
from router_harness import Cluster, harmony_ids, wait_for

SCRIPT = "<|channel|>final<|message|>ok<|return|>"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=2, script=harmony_ids(SCRIPT), decode_kv_blocks=[4096, 2048])
    yield c
    c.close()


def scrape(cluster) -> str:
    return httpx.get(cluster.base_url + "/metrics").text


def gauge(text: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return value


def test_decode_kv_usage_ratio_is_the_pool_share_in_use(cluster, rng):
    a, b = cluster.decode
    used_a, used_b = rng.randrange(1, 4096), rng.randrange(1, 2048)
    a.reservations["x"], b.reservations["y"] = used_a, used_b
    expected = (used_a + used_b) / (4096 + 2048)
    assert wait_for(lambda: abs(gauge(scrape(cluster), "pdserve_decode_kv_usage_ratio") - expected) < 1e-9)
    a.reservations.clear()
    b.reservations.clear()
    assert wait_for(lambda: gauge(scrape(cluster), "pdserve_decode_kv_usage_ratio") == 0.0)


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(kind, ())
            names |= {name + s for s in suffixes}
    return names


def test_every_metric_the_chart_and_dashboard_name_is_exported(cluster):
    httpx.post(cluster.base_url + "/v1/chat/completions", timeout=10, json={
        "model": "gpt-oss-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    exported = _exported(scrape(cluster))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["decode"]["keda"] = {**values["decode"]["keda"], "enabled": True}
    values["grafanaDashboard"] = {**values["grafanaDashboard"], "enabled": True}
    docs, _ = render_values(values)
    texts = [json.dumps(docs), (CHART / "values.yaml").read_text(),
             (CHART / "dashboards" / "pdserve.json").read_text()]
    named = {m for t in texts for m in re.findall(r"\bpdserve_[a-z_]+[a-z]", t)}
    named -= {"pdserve_pb2", "pdserve_pb2_grpc"}
    assert {"pdserve_decode_kv_usage_ratio", "pdserve_time_to_first_token_seconds_bucket"} <= named
    missing = sorted(named - exported)
    assert not missing, f"named in the chart or dashboard but not exported by the router: {missing}"
