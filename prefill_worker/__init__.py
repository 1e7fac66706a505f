"""Prefill worker: batch-size-1 prompts on a TP group; KV written straight into decode workers."""
