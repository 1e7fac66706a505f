"""API keys and TLS on the router (router/auth.py): /v1 and gRPC Generate need a key, probes and
metrics stay open, a rotated key file takes effect without a restart, both ports speak TLS."""

from __future__ import annotations

import datetime
import os
import secrets
import ssl

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.router.config import ConfigError, RouterConfig
from router_harness import FakeDecode, FakePrefill, KVFabric, RouterThread, Script, harmony_ids, wait_for

CHAT = {"model": "gpt-oss-test", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def workers():
    fabric, script = KVFabric(), Script(harmony_ids("<|channel|>final<|message|>ok<|return|>"))
    prefill, decode = FakePrefill("p0", fabric, script), FakeDecode("d0", fabric, script)
    yield prefill, decode
    prefill.server.die()
    decode.server.die()


def self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def write_keys(path, *keys, bump_ns: int = 0):
    path.write_text("# accepted keys\n\n" + "\n".join(keys) + "\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump_ns))


def test_api_keys_guard_v1_and_generate_not_probes(tmp_path, workers):
    prefill, decode = workers
    key, other = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    key_file = tmp_path / "keys"
    write_keys(key_file, other, key)
    router = RouterThread([prefill.address], [decode.address], api_key_file=str(key_file))
    try:
        router.wait_ready()  # /health needs no key
        url = router.base_url + "/v1/chat/completions"
        for headers in ({}, {"Authorization": f"Bearer {key[:-1]}"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}):
            denied = httpx.post(url, json=CHAT, headers=headers)
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "invalid_api_key"
            assert denied.headers["www-authenticate"] == "Bearer"
        assert httpx.get(router.base_url + "/v1/models").status_code == 401
        ok = httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(router.base_url + "/metrics").text  # open to the scraper
        assert 'pdserve_requests_total{endpoint="chat_completions",status="401"} 4.0' in metrics

        with grpc.insecure_channel(router.grpc_address) as channel:
            stub = pbg.GeneratorStub(channel)
            request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
            with pytest.raises(grpc.RpcError) as denied_rpc:
                list(stub.Generate(request, timeout=10))
            assert denied_rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            chunks = list(stub.Generate(request, timeout=10, metadata=[("authorization", f"Bearer {key}")]))
            assert chunks and chunks[-1].finish_reason
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

        # rotation: the Secret's file changes, the old key stops working, no restart
        rotated = secrets.token_urlsafe(24)
        write_keys(key_file, rotated, bump_ns=10**9)
        assert httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {key}"}).status_code == 401
        assert httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {rotated}"},
                          timeout=10).status_code == 200
    finally:
        router.close()


def test_tls_on_both_ports(tmp_path, workers):
    prefill, decode = workers
    cert, key = self_signed(tmp_path)
    router = RouterThread([prefill.address], [decode.address], tls_cert_file=cert, tls_key_file=key)
    try:
        base = f"https://localhost:{router.router.http_port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=10) as client:
            assert client.get(base + "/metrics").status_code == 200
            # the router answers before its health checks have seen the workers (503 until then)
            assert wait_for(lambda: client.get(base + "/health").status_code == 200, 10)
            reply = client.post(base + "/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://localhost:{router.router.http_port}/metrics", timeout=5)  # no plain text
        credentials = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        with grpc.secure_channel(f"localhost:{router.router.grpc_port}", credentials) as channel:
            chunks = list(pbg.GeneratorStub(channel).Generate(pb.GenerateRequest(prompt_token_ids=[1, 2]),
                                                              timeout=10))
            assert chunks and chunks[-1].finish_reason
    finally:
        router.close()


def test_bad_security_settings_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="both"):
        RouterConfig(tls_cert_file="/x.crt")
    empty = tmp_path / "keys"
    empty.write_text("# nothing\n\n")
    from pdserve.router.auth import ApiKeys, TLSFiles
    with pytest.raises(ConfigError, match="holds no key"):
        ApiKeys(empty)
    with pytest.raises(ConfigError, match="cannot read"):
        ApiKeys(tmp_path / "missing")
    with pytest.raises(ConfigError, match="does not exist"):
        TLSFiles(str(tmp_path / "no.crt"), str(tmp_path / "no.key"))
