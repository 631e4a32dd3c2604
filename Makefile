# The two commands of the README. Both create .venv if missing and install the pinned set.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.laminar-installed
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`, each taking whole test files (0: one process)
TEST_WORKERS ?= 2

.PHONY: demo test docs setup clean ibverbs bubblewrap gpu-wheels

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt setup.py
	@$(MAKE) --no-print-directory ibverbs bubblewrap
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements.txt -r requirements-dev.txt
	$(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Mooncake's transfer engine links libibverbs.so.1 even for its TCP transport. Best effort:
# without it (and without root to install it) the Mooncake tests are skipped, saying why.
ibverbs:
	@if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libibverbs1 (Debian) for Mooncake's transfer engine"; \
	    apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; } || \
	    echo "note: could not install libibverbs1; the Mooncake tests will be skipped"; \
	  else echo "note: libibverbs1 is missing (apt-get install libibverbs1); the Mooncake tests will be skipped"; fi; \
	fi

# The tool sandbox of agent jobs is bubblewrap (agents/bubblewrap.py). Installed where this
# can (root with apt-get); without it an agent job refuses to start, naming the fix, and the
# sandbox tests fail saying so (rollout.sandbox=unsafe-local runs tools with no isolation).
# Started by root, bwrap runs as its own unprivileged system user, laminar-sandbox, made here.
bubblewrap:
	@if ! command -v bwrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing bubblewrap (Debian) for the tool sandbox"; \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
	    echo "note: could not install bubblewrap; agent jobs and the sandbox tests need it"; \
	  else echo "note: bwrap is missing (apt-get install bubblewrap); agent jobs and the sandbox tests need it"; fi; \
	fi
	@if [ "$$(id -u)" = 0 ] && ! id laminar-sandbox >/dev/null 2>&1; then \
	  echo "creating the system user laminar-sandbox, the tool sandbox's host user"; \
	  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin laminar-sandbox || \
	  echo "note: could not create laminar-sandbox; the tool sandbox runs as nobody"; \
	fi

# The wheels tools/gpu_check.sh installs on an offline GPU machine (docs/gpu.md): Python 3.12,
# manylinux x86_64, only what a CUDA image with torch lacks. Run where there is internet; a
# wheel already in $(GPU_WHEELS) is not fetched again. Fails if they come to over 40 MB.
GPU_WHEELS ?= gpu-wheels
GPU_WHEEL_PINS ?= megatron-core==0.19.2 hydra-core==1.3.8 omegaconf==2.3.1 zstandard==0.25.0 \
	transformers==5.23.0
GPU_WHEEL_SDISTS ?= antlr4-python3-runtime==4.9.3
# more wheels where a GPU machine's own are too old (e.g. huggingface-hub for transformers)
GPU_WHEEL_EXTRA ?=
GPU_WHEELS_MAX_BYTES ?= 40000000
GPU_PIP ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip --disable-pip-version-check -q

gpu-wheels:
	@set -e; mkdir -p $(GPU_WHEELS); \
	for pin in $(GPU_WHEEL_PINS) $(GPU_WHEEL_EXTRA) $(GPU_WHEEL_SDISTS); do \
	  stem=$$(echo "$${pin%%==*}" | tr 'A-Z.-' 'a-z__')-$${pin##*==}-; \
	  if ls $(GPU_WHEELS)/$$stem*.whl >/dev/null 2>&1; then echo "have $$pin"; continue; fi; \
	  echo "fetching $$pin"; \
	  case " $(GPU_WHEEL_SDISTS) " in \
	    *" $$pin "*) $(GPU_PIP) wheel --no-deps --no-binary=:all: -w $(GPU_WHEELS) "$$pin";; \
	    *) $(GPU_PIP) download --no-deps --only-binary=:all: --implementation cp \
	         --python-version 3.12 --abi cp312 --platform manylinux2014_x86_64 \
	         --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	         -d $(GPU_WHEELS) "$$pin";; \
	  esac; \
	  ls $(GPU_WHEELS)/$$stem*.whl >/dev/null 2>&1 || { echo "error: no wheel $$stem*.whl"; exit 1; }; \
	done; \
	ls -l $(GPU_WHEELS)/*.whl | awk '{printf "%10d  %s\n", $$5, $$9; t += $$5} \
	  END {printf "%10d  total (limit $(GPU_WHEELS_MAX_BYTES))\n", t; exit t > $(GPU_WHEELS_MAX_BYTES)}' \
	  || { echo "error: the wheels in $(GPU_WHEELS)/ are over $(GPU_WHEELS_MAX_BYTES) bytes"; exit 1; }

demo: $(STAMP)
	PYTHONWARNINGS=ignore $(PY) -m laminar_mcore.launch

test: $(STAMP) bubblewrap
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The documentation site, strict: a broken link or anchor, or any other warning, fails the build.
# The configuration reference is rendered from config/schema.py at build time (docs/hooks.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) outputs .pytest_cache site
