"""Static discovery, address checks and the backend factory."""

from __future__ import annotations

import pytest

from pdserve.router.discovery import (
    Discovery,
    DiscoveryError,
    StaticDiscovery,
    WorkerEndpoint,
    make_discovery,
    normalize_address,
)


def test_static_reports_the_full_set_once():
    calls = []
    d = make_discovery("static", prefill=["10.0.0.2:50061,10.0.0.1:50061"],
                       decode=" [fd00::1]:50062 ")
    assert isinstance(d, StaticDiscovery) and isinstance(d, Discovery)
    d.start(calls.append)
    d.stop()
    assert calls == [[
        WorkerEndpoint("decode", "[fd00::1]:50062", "[fd00::1]:50062"),
        WorkerEndpoint("prefill", "10.0.0.1:50061", "10.0.0.1:50061"),
        WorkerEndpoint("prefill", "10.0.0.2:50061", "10.0.0.2:50061"),
    ]]


def test_static_deduplicates_and_normalizes():
    d = StaticDiscovery(["host-a:050061", "host-a:50061"], ["host-b:1"])
    assert [e.address for e in d.endpoints] == ["host-b:1", "host-a:50061"]


@pytest.mark.parametrize("bad", ["host", ":5", "host:", "host:0", "host:70000", "host:x1",
                                 "fd00::1:5", "[fd00::1:5", "[nothex]:5"])
def test_bad_addresses_are_rejected(bad):
    with pytest.raises(DiscoveryError, match="worker address"):
        normalize_address(bad)


def test_factory_errors_name_the_problem():
    with pytest.raises(DiscoveryError, match="unknown discovery kind 'consul'.*kubernetes, ray, static"):
        make_discovery("consul")
    with pytest.raises(DiscoveryError, match="not \\['port'\\]"):
        make_discovery("ray", port=1)
    with pytest.raises(DiscoveryError, match="not \\['namespaces'\\]"):
        make_discovery("kubernetes", namespaces="x")
    with pytest.raises(DiscoveryError, match="not \\['selector'\\]"):
        make_discovery("static", prefill=[], selector="x")
    with pytest.raises(DiscoveryError, match="role"):
        WorkerEndpoint("router", "a:1", "a")


def test_kubernetes_through_the_factory_drops_unset_options():
    from kubernetes import client

    api_client = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))
    d = make_discovery("kubernetes", namespace="serving", prefill_selector="a=prefill",
                       decode_selector="a=decode", port_name=None, api_client=api_client)
    assert (d.namespace, d.port_name) == ("serving", "grpc")
    assert d.selectors == {"prefill": "a=prefill", "decode": "a=decode"}
