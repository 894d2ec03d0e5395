# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap .venv once.
#
# TORCH_SPEC picks the torch that goes into the venv. The default pins the release whose CPU
# build lies on this project's CI machines (pip takes it from local disk: no multi-GB CUDA
# download there; on other machines the same pin fetches PyPI's build for your platform).
# On a GPU machine, ask for what you need, e.g.  make test TORCH_SPEC='torch>=2.6'
# An existing torch in the venv that satisfies the project is never replaced.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= dev,triton,viz,data,tensorboard,hf
# INSTALLER installs the packages into the venv: uv (the default; pip installs it into the venv
# first) or pip. The same packages either way; uv downloads and unpacks them in parallel: 18 s
# against 45 s on two cores from empty caches. uv reads no pip configuration: pip's find-links,
# index-url and cert (as SSL_CERT_FILE, unless set) are passed on (`pip config list`);
# INSTALLER=pip uses pip with all of its own.
INSTALLER  ?= uv
UV_SPEC    ?= uv>=0.5
PYTEST_ARGS ?=
# Test files run in this many pytest-xdist worker processes (two: the CI machine's two cores;
# every file stays in one worker, so its module fixtures are built once). 0 runs them in this
# process, one after the other.
TEST_WORKERS ?= 2

BIN   := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped

# Bytecode is cached in the venv ($(VENV)/pycache), whatever the environment says: with
# PYTHONDONTWRITEBYTECODE set (as on this project's CI machines) every fresh interpreter, and the
# suite starts hundreds (a rank under torchrun, a CLI run, a Triton-interpreter child), compiled
# torch's modules from source again: `import torch` took 3.7 s instead of 1.8 s on two cores.
# An empty PYTHONDONTWRITEBYTECODE counts as unset; the prefix keeps the cache out of the tree.
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache

.PHONY: demo test test-quick venv bench clean-venv help

help:
	@echo "make demo   run the main job on CPU ranks spawned here (gloo)"
	@echo "make test   run the test suite (TEST_WORKERS=2 pytest-xdist workers; 0: one process)"
	@echo "make test-quick  the inner loop: no Triton-interpreter cases, no slow end-to-end runs"
	@echo "variables: TORCH_SPEC='$(TORCH_SPEC)' EXTRAS='$(EXTRAS)' INSTALLER=$(INSTALLER) PYTHON=$(PYTHON)"

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), f"Python >= 3.10 needed, found {sys.version.split()[0]}"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@case "$(INSTALLER)" in uv|pip) ;; *) echo "INSTALLER=$(INSTALLER): uv or pip" >&2; exit 2;; esac
	@# one install call where torch is missing (one resolution: ~8 s less than two calls)
	@if $(BIN)/python -c 'import torch' 2>/dev/null; then torch=""; else torch='"$(TORCH_SPEC)"'; fi; \
	if [ "$(INSTALLER)" = uv ]; then \
	  $(BIN)/python -m pip install -q --no-compile "$(UV_SPEC)" || exit 1; \
	  conf=$$($(BIN)/python -m pip config list 2>/dev/null); \
	  links=$$(echo "$$conf" | sed -n "s/^[^=]*\.find-links='\(.*\)'$$/\1/p" | tr ' ' '\n' | sort -u); \
	  index=$$(echo "$$conf" | sed -n "s/^[^=]*\.index-url='\(.*\)'$$/\1/p" | head -1); \
	  cert=$$(echo "$$conf" | sed -n "s/^[^=]*\.cert='\(.*\)'$$/\1/p" | head -1); \
	  flags="$$(for l in $$links; do printf -- '--find-links %s ' "$$l"; done)$${index:+--index-url $$index}"; \
	  certenv="$${cert:+SSL_CERT_FILE=$${SSL_CERT_FILE:-$$cert} }"; \
	  cmd="$${certenv}$(BIN)/uv pip install -q --python $(BIN)/python --link-mode copy $$flags $$torch -e \".[$(EXTRAS)]\""; \
	else \
	  cmd="$(BIN)/python -m pip install -q --no-compile $$torch -e \".[$(EXTRAS)]\""; \
	fi; \
	echo "$$cmd"; eval "$$cmd"
	@touch $(STAMP)

# The trainer on PP=2 x EP=2 with OVERLAP_B_F vs its baseline (configs/demo_pp2_ep2.yaml, embedded);
# e.g. make demo DEMO_ARGS='--config my.yaml --steps 10'
demo: $(STAMP)
	$(BIN)/overlap-runtime demo $(DEMO_ARGS)

# pytest exits 5 when it collects no tests: that is not a failure of the suite.
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)
test: $(STAMP)
	@$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

# The inner loop while editing: everything but the Triton-interpreter cases and the slow
# end-to-end runs (the examples on their ranks, the demo and train commands in fresh interpreters).
# Not a substitute for `make test`, which CI runs.
test-quick: $(STAMP)
	@$(BIN)/python -m pytest -q $(XDIST) -m "not triton and not slow" $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

clean-venv:
	rm -rf $(VENV)
