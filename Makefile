# Two commands on a fresh machine: `make serve` and `make test`. Both install what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without torch, a bare `torch` requirement pulls a multi-GB CUDA build; pinning the
# CPU release first makes the project's own range accept it. A GPU machine keeps its CUDA torch.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test lint bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

serve: install
	$(VENV)/bin/serve run deployments:app

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .
