# Two entry points for a fresh machine: `make run` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup run test lint format demo package clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -c 'from backend.demo.build import ensure_demo; ensure_demo()'

run: demo
	$(VENV)/bin/bevy

test: setup lint
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

# The Debian package, built offline with Briefcase (README "Installers"): dist/*.deb.
package:
	packaging/build-deb.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist *.egg-info
