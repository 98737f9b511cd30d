# rankscope: set-up, tests, benchmarks, demo. GNU make.
#
#   make test        install what is missing, then the whole test suite
#   make test-fast   the same without the tests marked slow
#   make bench       every benchmarks/*.py in turn (but gpu_check.py)
#   make accuracy    the randomized fault campaign (benchmarks/accuracy.py; ACCURACY_ARGS='--trials 200')
#   make gpu-check   the CUDA paths on this machine's GPU, in one table (refuses without a CUDA GPU)
#   make demo        the demo (rankscope demo: collector, dashboard, 8-rank run; Ctrl-C stops it)
#   make screenshot  the README's picture: the browser test's heat map, copied to docs/images/
#   make protos      regenerate rankscope/protos/v1/*_pb2*.py from the .proto files

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# Installed before anything else: this machine has a local CPU wheel of torch 2.13.0, while a
# bare torch requirement would pull the newest CUDA build (GBs). Override on machines with
# another torch, e.g. make TORCH='torch==2.11.0'.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Two pytest workers: one runs the timing tests one at a time, the other the rest at low CPU weight
# (tests/suite_lanes.py). A third slowed the timing tests by half and failed them (session 34).
# TEST_WORKERS=0 runs everything in one process, in file order.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --rerun-show-tracebacks
# gpu_check.py refuses without a CUDA GPU (exit 1): `make gpu-check` runs it, not `make bench`.
BENCHMARKS := $(sort $(filter-out benchmarks/gpu_check.py,$(wildcard benchmarks/*.py)))

.PHONY: venv install browser slurm test test-fast bench accuracy gpu-check demo screenshot protos clean distclean

venv: $(PY)

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

# Reinstalls only when the package metadata changed (editable install: code changes need none).
# Every part and the tests: `all` is the agent with its gpu and stacks extras, the collector and the
# dashboard (pyproject.toml; `pip install rankscope` alone is the agent).
$(STAMP): pyproject.toml setup.py | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q numpy
	$(PIP) install -q -e '.[all,dev]'
	touch $@

# $(call apt-install,WHO NEEDS IT,PACKAGES,TEST THAT THEY ARE PRESENT): Debian's packages, installed
# as root where missing; elsewhere a warning that what needs them will be skipped. Silent when present.
define apt-install
	@if $(3); then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's $(2) for $(1)"; \
	  log=$$(mktemp); \
	  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(2); } >"$$log" 2>&1; then \
	    tail -n 20 "$$log" >&2; \
	    echo "warning: could not install $(2): $(1) will be skipped" >&2; \
	  fi; \
	  rm -f "$$log"; \
	else \
	  echo "warning: $(2) missing and we are not root: $(1) will be skipped" >&2; \
	fi
endef

# Chromium for the browser tests.
browser:
	$(call apt-install,the browser tests,chromium,[ -x /usr/bin/chromium ])

# Slurm and munge for the Slurm test bed (rankscope testbed up --slurm) and its tests.
slurm:
	$(call apt-install,the Slurm test bed's tests,slurm-wlm munge,command -v slurmd >/dev/null && command -v munged >/dev/null)

test: install browser slurm
	$(PYTEST) $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

bench: install
	@for b in $(BENCHMARKS); do echo "== $$b"; $(PY) "$$b"; echo; done

# Diagnosis accuracy over a randomized fault campaign (docs/benchmarks.md): the Lightning and Accelerate
# jobs need the campaign extra, installed beside the pinned torch (pip would not replace it then).
ACCURACY_ARGS ?=
accuracy: install
	$(PIP) install -q -e '.[campaign]' '$(TORCH)'
	$(PY) benchmarks/accuracy.py $(ACCURACY_ARGS)

# The CUDA paths (CUDA-event timing, NCCL completion, the agent's cost on the trainer, MFU) in one
# table; on a machine without a CUDA GPU it says so in one line and fails. docs/benchmarks.md.
gpu-check: install
	$(PY) benchmarks/gpu_check.py

demo: install
	$(VENV)/bin/rankscope demo

# The README's picture: the heat map page as the browser test drew it on a real recorded run.
screenshot: install browser
	$(PY) -m pytest tests/test_dashboard.py -q -k "real_browser and heatmap"
	cp test-artifacts/dashboard/heatmap.png docs/images/dashboard.png

# Regenerate the wire contract's Python code after editing rankscope/protos/v1/*.proto.
protos: install
	$(PY) -m rankscope.protos.generate

clean:
	rm -rf build dist *.egg-info .pytest_cache test-artifacts .whl
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
