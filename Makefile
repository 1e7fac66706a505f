# `make serve` and `make test` work on a fresh machine: each installs what it needs into .venv.
# The CPU build of torch goes in first (an unpinned `torch` would pull a multi-GB CUDA build);
# override TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: install serve test test-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
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
