# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest arguments, e.g. make test PYTEST_ARGS="-k plan -x"
PYTEST_ARGS ?=

.PHONY: install demo test protos check-protos bench clean

install: $(STAMP)

# The CI lock pins torch==2.13.0+cpu; pip finds that wheel through PIP_FIND_LINKS or
# PIP_EXTRA_INDEX_URL (PyTorch's CPU index) on machines that do not have it locally.
$(STAMP): requirements/ci.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/ci.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshgate demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh

# Fails when the committed stubs in meshgate/v1/ differ from what proto/ generates.
check-protos: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	PYTHON=$(PY) scripts/gen_protos.sh "$$tmp" && \
	diff -r -x __init__.py -x __pycache__ "$$tmp/meshgate/v1" meshgate/v1 \
	  && echo "meshgate/v1 stubs are fresh" \
	  || { echo "stale stubs in meshgate/v1: run make protos" >&2; exit 1; }

# The bench extra (py-spy for native profiles) is not in the CI lock: installed here only.
bench: $(STAMP)
	$(PY) -m pip install --quiet --no-build-isolation -e '.[bench]'
	$(PY) -m bench $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
