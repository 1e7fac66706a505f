"""pdserve gRPC contracts: generated protobuf messages and service stubs.

The generated modules are committed; regenerate them from the repository root after editing
`pdserve.proto` (tests/test_proto.py fails until you do):

    python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/pdserve.proto

The generated code checks its runtime at import: protobuf >= 7.35.1 and grpcio >= 1.85.1.
"""

from pdserve.proto import pdserve_pb2
from pdserve.proto import pdserve_pb2_grpc

__all__ = ["pdserve_pb2", "pdserve_pb2_grpc"]
