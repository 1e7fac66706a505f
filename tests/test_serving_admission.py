"""More concurrent streams than decode slots and KV room, through `pdserve serve`'s processes:
every accepted stream finishes (none cut mid-stream, no 5xx), the excess waits at the router or
on the decode worker, and every KV block is free again at the end."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.launch.serve import ClusterSpec, LocalCluster
from ports import server_ports
from test_serving_e2e import wait_kv_drained

pytestmark = pytest.mark.slow

PROMPT_TOKENS, MAX_TOKENS = 20, 28  # 48 positions: 3 KV blocks of 16


async def _stream(client: httpx.AsyncClient, prompt: list[int], seed: int) -> tuple[int, str, int]:
    """(HTTP status, how the stream ended, completion tokens)."""
    body = {"model": "gpt-oss", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.json()["error"]["code"], 0
        tokens = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return 200, "done", tokens
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return 200, f"error event: {event['error']}", tokens
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return 200, "cut", tokens


def test_streams_beyond_slots_and_kv_room_wait_and_all_finish(tiny_mxfp4, tmp_path, rng):
    # 2 batch slots and KV room for 4 requests; 10 at once: 2 decode, 1 waits for a slot on the
    # decode worker (its KV already there: the router places up to slots + 25%), 7 wait at the
    # router
    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(),
                       max_batch_size=2, kv_blocks=4 * 3)
    prompts = [[rng.randrange(1000, 200_000) for _ in range(PROMPT_TOKENS)] for _ in range(10)]

    async def run() -> list[tuple[int, str, int]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as client:
            return await asyncio.gather(*(_stream(client, p, i) for i, p in enumerate(prompts)))

    with LocalCluster(spec, tmp_path / "logs") as cluster:
        results = asyncio.run(run())
        assert results == [(200, "done", MAX_TOKENS)] * len(prompts), results
        loads = wait_kv_drained(cluster)
        assert all(r.queued_requests == 0 for r in loads.values())
        metrics = httpx.get(cluster.url + "/metrics").text
        waited = [line for line in metrics.splitlines()
                  if line.startswith("pdserve_admission_queue_wait_seconds_count")]
        assert waited and float(waited[0].split()[-1]) > 0, waited  # the router queue was used
        # no 5xx from any API endpoint; the health probe's 503s while the cluster started are right
        errors = [line for line in metrics.splitlines() if line.startswith("pdserve_requests_total{")
                  and 'status="5' in line and 'endpoint="health"' not in line]
        assert not errors, errors
