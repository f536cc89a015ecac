# Two commands do all set-up on a fresh machine:
#   make demo   - venv, install, and the compatibility report (this machine + simulated H200/B200)
#   make test   - venv, install with test extras, the whole CPU test suite (and test-sglang)
#
# TORCH_SPEC pins the torch build installed first: this CPU machine's local
# wheel by default.  On a GPU box use e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ATTNREG := $(VENV)/bin/attnreg

.PHONY: demo test test-sglang test-vllm venv install-demo install-test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=77"

# Stamps re-run an install only when pyproject.toml changes.
$(VENV)/.demo-installed: pyproject.toml | $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[torch]"
	touch $@

# setuptools>=77 in the venv: the example and plugin packages declare an SPDX license
# (PEP 639), and the docs tests build the example with --no-build-isolation.
# The FlashMLA plugin without its kernel library (--no-deps): sgl-flash-mla needs
# CUDA and does not install here; the plugin's CPU tests run without it.
FLASHMLA_PLUGIN := plugins/attnreg-flashmla

$(VENV)/.test-installed: pyproject.toml $(FLASHMLA_PLUGIN)/pyproject.toml | $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench]" ruff "setuptools>=77"
	$(PIP) install -q --no-deps -e $(FLASHMLA_PLUGIN)
	touch $@ $(VENV)/.demo-installed

venv: $(PY)
install-demo: $(VENV)/.demo-installed
install-test: $(VENV)/.test-installed

demo: $(VENV)/.demo-installed
	$(PY) -m attnreg demo

# Four phases, each ending in pytest's one summary line (`-r fE`: failures and errors
# are listed, skips only counted; `pytest -ra` lists every skip reason).  The main suite
# runs on TEST_WORKERS pytest-xdist workers (docs/decisions.md, "make test in minutes");
# TEST_WORKERS=0 runs it in one process.  --dist loadfile: a file's tests run on one
# worker, so a module-scoped fixture (test_planted's conformance runs, the gloo ranks of
# test_sync_faults) is set up once, not once per worker that gets one of its tests.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -r fE

test: $(VENV)/.test-installed
	@echo "== attnreg test 1/4: main suite (tests/, $(TEST_WORKERS) workers) =="
	@$(PYTEST) -n $(TEST_WORKERS) --dist loadfile
	@$(MAKE) --no-print-directory $(SGLANG_VENV)/.installed $(VLLM_VENV)/.installed
	@# Phases 2-4 run at once (three processes, three venvs, one pytest each: together they
	@# keep both cores busy); each one's output is held and printed whole, in phase order.
	@logs=$$(mktemp -d); \
	$(PYTEST) $(FLASHMLA_PLUGIN)/tests > $$logs/2 2>&1 & p2=$$!; \
	$(MAKE) --no-print-directory test-sglang > $$logs/3 2>&1 & p3=$$!; \
	$(MAKE) --no-print-directory test-vllm > $$logs/4 2>&1 & p4=$$!; \
	wait $$p2; r2=$$?; wait $$p3; r3=$$?; wait $$p4; r4=$$?; \
	echo "== attnreg test 2/4: FlashMLA plugin suite ($(FLASHMLA_PLUGIN)/tests) =="; \
	cat $$logs/2; \
	echo "== attnreg test 3/4: sglang bridge suite (tests/integrations/sglang, $(SGLANG_VENV)) =="; \
	cat $$logs/3; \
	echo "== attnreg test 4/4: vLLM bridge suite (tests/integrations/vllm, $(VLLM_VENV)) =="; \
	cat $$logs/4; \
	rm -rf $$logs; \
	test $$r2 -eq 0 && test $$r3 -eq 0 && test $$r4 -eq 0

# sglang bridge tests in their own venv (docs/decisions.md: "make test-sglang"):
# sglang 0.5.23 and a pinned CPU set, installed without the resolver.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_LOCK := tests/integrations/sglang/requirements-cpu.txt

$(SGLANG_VENV)/.installed: pyproject.toml $(SGLANG_LOCK)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q "$(TORCH_SPEC)"
	$(SGLANG_PY) -m pip install -q --no-deps -r $(SGLANG_LOCK)
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	touch $@

test-sglang: $(SGLANG_VENV)/.installed
	@$(SGLANG_PY) -m pytest -q -r fE tests/integrations/sglang

# vLLM bridge tests in their own venv (docs/integrations/vllm.md): vLLM 0.33.0
# and a pinned CPU set, installed without the resolver; the FlashMLA plugin
# too, so vLLM's FLASHMLA maps to its declaration.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_LOCK := tests/integrations/vllm/requirements-cpu.txt

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_LOCK) $(FLASHMLA_PLUGIN)/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_PY) -m pip install -q --no-deps -e . -e $(FLASHMLA_PLUGIN)
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	@$(VLLM_PY) -m pytest -q -r fE tests/integrations/vllm

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check src tests $(FLASHMLA_PLUGIN)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
