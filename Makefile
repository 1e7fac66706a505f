# `make serve` and `make test` work on a fresh machine: each installs what it needs into .venv.
# The CPU build of torch goes in first (an unpinned `torch` would pull a multi-GB CUDA build);
# override TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: install serve test test-gpu clean proto

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[test]' 
	# OpenAI's reference implementation, for the logits tests (declares Python >= 3.12; works on 3.11)
	$(BIN)/pip install -q --no-deps --ignore-requires-python 'gpt-oss==0.0.9'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pdserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)

# Regenerate the gRPC stubs from proto/pdserve.proto (they import `pdserve.proto.pdserve_pb2`).
proto:
	rm -rf .proto-gen && mkdir -p .proto-gen/src/pdserve/proto
	cp proto/pdserve.proto .proto-gen/src/pdserve/proto/
	$(BIN)/python -m grpc_tools.protoc -I.proto-gen/src --python_out=.proto-gen --grpc_python_out=.proto-gen .proto-gen/src/pdserve/proto/pdserve.proto
	cp .proto-gen/pdserve/proto/pdserve_pb2.py .proto-gen/pdserve/proto/pdserve_pb2_grpc.py proto/
	rm -rf .proto-gen
