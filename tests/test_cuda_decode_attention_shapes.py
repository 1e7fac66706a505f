"""Which launch shape the cluster decode attention (kernels/cuda_decode_attention.py) takes for a layer
and a batch: CPU only, no kernel runs (tests/gpu/test_cuda_decode_attention_gpu.py runs them)."""

from __future__ import annotations

import pytest

from pdserve.kernels import cuda_decode_attention as cda


@pytest.mark.parametrize("rows, cluster", [(1, 16), (2, 16), (3, 8), (4, 8)])
def test_full_layers_take_clusters_of_16_up_to_two_requests(rows, cluster):
    """Counted as the next power of two, as the grid is: three requests are a graph of four's shape."""
    assert cda.config_for(-1, rows).cluster == cluster
    assert cda.config_for(127, rows) is cda.WINDOWED_LAYERS


def test_without_the_few_requests_shape_every_batch_takes_full_layers(monkeypatch):
    monkeypatch.setattr(cda, "FULL_LAYERS_FEW", None)
    assert all(cda.config_for(-1, rows) is cda.FULL_LAYERS for rows in (1, 2, 4))


@pytest.mark.parametrize("cluster", [0, 17, 32])
def test_a_cluster_holds_one_to_sixteen_ctas(cluster):
    with pytest.raises(ValueError, match="1-16 CTAs"):
        cda.ClusterConfig(cluster=cluster, stages=2, max_rows=1)
