# Two commands on a fresh machine: `make serve` and `make test`. Both install what is missing,
# at the exact versions of requirements.lock (the set the suite was last green with).
VENV ?= .venv
PY := $(VENV)/bin/python
# The lock constrains every install, the build's own (setuptools) included; `LOCK=` lifts it.
LOCK ?= requirements.lock
PIP_INSTALL := PIP_CONSTRAINT=$(abspath $(LOCK)) $(PY) -m pip install -q
# On a machine without torch, a bare `torch` requirement pulls a multi-GB CUDA build; pinning the
# CPU release first makes the project's own range accept it. A GPU machine keeps its CUDA torch.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test lint test-latest lock
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) $(TORCH_PIN)
	$(PIP_INSTALL) -e ".[test]"
	touch $@

serve: install
	$(VENV)/bin/serve run deployments:app

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .

# The suite against the newest releases, in a venv of its own; `make lock` then writes what it
# installed into the lock.
test-latest:
	$(MAKE) test VENV=.venv-latest LOCK=
	@echo "green against the newest releases: 'make lock VENV=.venv-latest' refreshes $(LOCK)"

lock:
	{ echo "# Exact versions the suite was last green with; every make install uses them."; \
	  echo "# Refresh: make test-latest, then make lock VENV=.venv-latest."; \
	  $(PY) -m pip freeze --all --exclude-editable | sed -e 's/+cpu$$//'; } > requirements.lock
