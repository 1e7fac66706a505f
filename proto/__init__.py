"""pdserve gRPC contracts: generated protobuf messages and service stubs.

The generated modules are committed; regenerate them from the repository root after editing
`pdserve.proto` (tests/test_proto.py fails until you do):

    python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/pdserve.proto

The generated code checks its runtime at import: protobuf >= 7.35.1 and grpcio >= 1.85.1. It is
imported when first used (`from pdserve.proto import pdserve_pb2`), so the package's light modules
(the workers' flags in `lifecycle`) load without gRPC.
"""

import importlib

__all__ = ["pdserve_pb2", "pdserve_pb2_grpc"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
