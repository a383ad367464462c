# Two commands on a fresh machine: `make course` (run every notebook) and `make test`.
PYTHON ?= python3
# COURSE_VENV: an environment made elsewhere (the container's, .devcontainer/Dockerfile).
VENV   := $(or $(COURSE_VENV),.venv)
BIN    := $(VENV)/bin
# Nothing is downloaded at run time: models come from configs, data is generated.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONPATH := $(CURDIR)/code
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup check check-python course exercise exercises test test-nproc stress lab images site clean \
        lint record

setup: $(VENV)/.installed

# The venv needs Python 3.11 or 3.12 (what the pins' Requires-Python allow: transformers 5.23 and
# numpy 2.4 need 3.11; tested with 3.11): checked before making it.
define check_python
v=$$($(PYTHON) -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null); \
case "$$v" in 3.11.*|3.12.*) ;; \
  *) echo "make: the course needs Python 3.11 or 3.12 (tested: 3.11), but" \
          "$(PYTHON) is $${v:+Python }$${v:-not found}; run e.g." \
          "make PYTHON=python3.12 $(or $(MAKECMDGOALS),setup)" >&2; \
     exit 1;; \
esac
endef

check-python:
	@$(check_python)

# Which torch: TORCH_INDEX=auto (the default) takes the CPU build from PyTorch's CPU wheel index
# on Linux without an NVIDIA GPU (PyPI's Linux torch is the CUDA build: GBs), and pip's usual
# sources elsewhere, or where that index cannot be reached (tried for 5 s); cpu: that index on
# any machine; pypi: pip's usual sources only; a URL: that index. See
# code/distkit/course/torch_wheels.py. To change it after set-up: rm -r .venv; make setup ...
TORCH_INDEX ?= auto

# Rebuilt whenever the pins change. pip takes its settings from the environment too (e.g.
# PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS for a local wheel folder).
$(VENV)/.installed: requirements.txt
	@test -x $(BIN)/python || { $(check_python); }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	torch=$$($(BIN)/python -m distkit.course.torch_wheels $(TORCH_INDEX)) && \
	  $(BIN)/python -m pip install --quiet --disable-pip-version-check $$torch -r requirements.txt
	touch $@

# A pre-flight for a participant's machine (a workshop's laptops): one PASS/WARN/FAIL line per
# check, with the fix; exit status 1 on any FAIL. See code/distkit/course/check.py.
check: setup
	$(BIN)/python -m distkit.course.check

# FAST=1: each notebook with the small parameter set of a live session (about a minute each;
# the table is FAST in code/distkit/course/run_course.py).
course: setup
	$(BIN)/python -m distkit.course.run_course$(if $(FAST), --fast)

# Check a learner's exercise: make exercise EX=03.1 (the list: make exercise). One line per check.
exercise: setup
	$(BIN)/python -m distkit.course.exercise $(if $(EX),$(EX),--list)

# Maintainers: the exercises' starters are generated from their solutions (### BEGIN SOLUTION
# regions). A starter edited since it was generated (a learner's work) is skipped and named;
# FORCE=1 overwrites it, keeping the edited text as FILE.bak.
.PHONY: starters
starters: setup
	$(BIN)/python -m distkit.course.exercise --write$(if $(FORCE), --force)

# The old name of `make starters`, one letter from `make exercise`: with EX= it changes nothing.
exercises: setup
	@if [ -n "$(EX)" ]; then echo "make exercises: did you mean make exercise EX=$(EX)" \
	  "(checks your exercise)? Nothing was changed." >&2; exit 2; fi
	@echo "make exercises: the old name of make starters (to check an exercise:" \
	  "make exercise EX=NN.k)" >&2
	$(BIN)/python -m distkit.course.exercise --write$(if $(FORCE), --force)

# The script tests two files at a time (pytest-xdist; TEST_JOBS=1: one at a time): on 2 cores
# one file's waits (a launch's start, a demo's timeout) overlap the other's work. Then the
# notebooks (nbval) and the tests that measure the machine's load, one at a time (both run;
# either failing fails the target).
TEST_JOBS ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --durations=15; a=$$?; \
	$(BIN)/python -m pytest -m "(notebook or alone) and not second_nproc and not stress" \
	  --durations=10; b=$$?; exit $$((a | b))

# The course's style (ruff.toml: pyflakes, pycodestyle, 100 characters); CI runs it.
lint: setup
	$(BIN)/ruff check .

# Re-record a notebook's stored outputs: make record NB=04 (refused on a busy machine; see
# code/distkit/course/record.py). After editing markdown: python -m distkit.course.chapters --write.
record: setup
	@[ -n "$(NB)" ] || { echo "make record: say which notebook, e.g. make record NB=04" >&2; exit 2; }
	$(BIN)/python -m distkit.course.record $(wildcard notebooks/$(NB)_*.ipynb notebooks/$(NB))

# Every notebook once more under papermill at another process count (3; 4 for ch. 02), scripts and
# exercises at 3-4 ranks, and the exercises' wrong answers beyond the one `make test` keeps each:
# kept out of `make test`'s budget; CI (.ci/run, the GitHub workflow) runs both. Two test files
# at a time, as make test's script tests.
test-nproc: setup
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile -m second_nproc tests

# The tests that could depend on which rank fails or prints first (failure demos, launcher,
# restarts), STRESS_N times (default 20) with every core kept busy: not part of `make test`.
stress: setup
	$(BIN)/python tests/stress.py

# JupyterLab refuses to start as root (the user in most containers) without --allow-root.
ALLOW_ROOT = $(if $(filter 0,$(shell id -u)),--allow-root)

# It serves the repository root, so the notebooks' ../images/*.png lie inside what it serves (from
# notebooks/, every image was a 404), and opens at workspace/ once `make workspace` made it, else
# at notebooks/. tests/test_lab.py starts this same server: it reads the command with
# `make -s print-LAB_COMMAND`.
# In a container, LAB_IP=0.0.0.0 (.devcontainer/Dockerfile sets it) lets a published port reach it.
LAB_DIR ?= $(if $(wildcard workspace/*.ipynb),workspace,notebooks)
LAB_IP ?= 127.0.0.1
LAB_COMMAND = $(BIN)/jupyter lab --ip $(LAB_IP) --notebook-dir . \
              --LabApp.default_url=/lab/tree/$(LAB_DIR) $(ALLOW_ROOT)

# JupyterLab's defaults for this environment (overrides.json): no "get notified about Jupyter
# news?" toast over the notebook on a room's screens. Written once; an existing file is kept.
LAB_OVERRIDES = $(VENV)/share/jupyter/lab/settings/overrides.json

lab: setup
	@[ -z "$(ALLOW_ROOT)" ] || echo "make lab: running as root (as in containers): adding --allow-root" >&2
	@[ -e $(LAB_OVERRIDES) ] || { mkdir -p $(dir $(LAB_OVERRIDES)) && echo \
	  '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}' > $(LAB_OVERRIDES); }
	$(LAB_COMMAND)

# Your own copies of the notebooks, in workspace/ (git ignores it): run and edit them there and
# the clone stays as it came, so `git pull` brings the course's fixes. A copy you have is never
# replaced (delete it to get the course's current version); `make lab` then opens workspace/.
.PHONY: workspace
workspace:
	@mkdir -p workspace
	@for nb in notebooks/*.ipynb; do name=$${nb#notebooks/}; \
	  if [ -e "workspace/$$name" ]; then echo "make workspace: kept your workspace/$$name"; \
	  else cp "$$nb" "workspace/$$name" && echo "make workspace: copied $$nb"; fi; \
	done

print-%:  # the value of a variable: make -s print-LAB_COMMAND
	@echo '$($*)'

# Every chapter's GPU path (NCCL, bf16, offload, flight recorder, 2-D meshes with >= 4 GPUs) at
# tiny size, one PASS/FAIL/SKIP line per script; without CUDA it says so and exits 0. See
# code/distkit/course/gpu_smoke.py.
.PHONY: gpu-smoke
gpu-smoke: setup
	$(BIN)/python -m distkit.course.gpu_smoke $(if $(FIT),--fit)

# The capstone's script tests on another torch (a cluster's module is often 2.11 or 2.12): a venv
# of its own, build/venv-torch-VERSION, with the course's other pins. A GB-sized download and
# minutes of tests: not in make test or CI. make test-torch TORCH_VERSION=2.11.0 (the default).
TORCH_VERSION ?= 2.11.0
TORCH_VENV = build/venv-torch-$(TORCH_VERSION)
.PHONY: test-torch
test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	grep -v '^torch==' requirements.txt > $(TORCH_VENV)/requirements.txt
	$(TORCH_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  torch==$(TORCH_VERSION) -r $(TORCH_VENV)/requirements.txt
	$(TORCH_VENV)/bin/python -m pytest -p no:cacheprovider tests/test_ch06_scripts.py \
	  tests/test_ch06_recipe.py tests/test_ch06_slurm.py

# The explanatory diagrams in images/ are drawn by code, so a diagram is fixed and redrawn.
images: setup
	$(BIN)/python -m distkit.course.diagrams

# The course as a static website in build/site/, from the notebooks' stored outputs (nothing is
# executed; well under a minute): open build/site/index.html, or publish it (the GitHub workflow
# does, to GitHub Pages from main).
site: setup
	$(BIN)/python -m distkit.course.site build/site

clean:
	rm -rf build .pytest_cache
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) \
	  -prune -exec rm -rf {} +
