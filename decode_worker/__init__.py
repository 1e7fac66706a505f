"""Decode worker: continuous batching over a paged KV cache that prefill workers fill over NIXL."""
