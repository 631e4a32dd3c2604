# The two commands of the README. Both create .venv if missing and install the pinned set.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.laminar-installed
PYTEST_ARGS ?=

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements.txt -r requirements-dev.txt
	$(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	PYTHONWARNINGS=ignore $(PY) -m laminar_mcore.launch

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
