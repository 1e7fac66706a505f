"""pdserve router: OpenAI-compatible HTTP API and gRPC `Generate` in front of prefill/decode pools.

One request's way: validate and render (openai_api / grpc_server) -> pick a (prefill, decode) pair
(policy over registry) -> Reserve, Prefill, Decode (orchestrator) -> parse and stream back.
Entry points live in `router.main` (`add_router_args`, `run_router`, `build_router`).
"""
