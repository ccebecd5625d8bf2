# The README's commands. Each installs first when needed, so a fresh clone needs only these.
VENV   := .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
SHARED := $(wildcard ../shared/conformance/*.toml)

.PHONY: install browser agents demo docs test fuzz mutmut bench diagrams lint typecheck clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# the console tests drive a real headless browser: Debian's chromium, installed only as root with
# apt-get (CI, a fresh machine); anywhere else its tests skip and say what to install
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || command -v google-chrome >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -q -o DPkg::Lock::Timeout=120 >/dev/null && \
	    apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 chromium >/dev/null \
	    || echo "browser: apt-get failed: the console's browser tests will skip"; \
	  else echo "browser: no chromium and cannot install it here (not root, or no apt-get): the console's browser tests will skip (install chromium to run them)"; fi; }

# the agent clients tests/gateway/test_agents.py runs: the Python ones (the `agents` extra) and the npm ones
# pinned in tests/agent_clients/package-lock.json (npm ci, again only when the lock changes). Without
# npm or a registry it says so and goes on: those tests then skip, each naming what is missing.
AGENT_NPM := tests/agent_clients/node_modules/.installed-stamp
AGENT_PY  := $(VENV)/.agents-stamp
agents: install $(AGENT_PY) $(AGENT_NPM)

$(AGENT_PY): pyproject.toml $(STAMP)
	@$(PY) -m pip install --quiet -e '.[agents]' && touch $@ \
	  || echo "agents: pip could not install the agents extra; its tests will skip"

$(AGENT_NPM): tests/agent_clients/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	  (cd tests/agent_clients && npm ci --no-audit --no-fund --loglevel=error) && touch $@ \
	  || echo "agents: npm ci failed in tests/agent_clients; the npm clients' tests will skip"; \
	else echo "agents: npm is not installed; the npm clients' tests will skip"; fi

demo: install
	$(BIN)/relayline demo

# the manual (docs/, mkdocs.yml) as a site in site/; strict: a dead link or a page missing from
# the navigation fails the build
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: install browser agents
	bash .ci/services
	$(BIN)/relayline diagram --check
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory typecheck
	HYPOTHESIS_PROFILE=ci $(BIN)/pytest

fuzz: install
	HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -m "property or fuzz" -x

# mutation testing of machines/ ([tool.mutmut] in pyproject.toml) in a view in .mutmut/ (machines/
# as relayline/machines, the tests, ../shared), then the score. It resumes: a mutant keeps its verdict
# while its function is unchanged (rm -rf .mutmut to start over); MUTANTS="name-or-pattern ..." re-runs
# those. Under nice, one child by default: the machine is shared.
MUTMUT_CHILDREN ?= 1
mutmut: install
	$(PY) -m pip install --quiet -e '.[mutation]'
	mkdir -p .mutmut/relayline
	ln -sfn $(CURDIR)/machines .mutmut/relayline/machines
	for p in tests adapters pyproject.toml; do ln -sfn $(CURDIR)/$$p .mutmut/$$p; done
	ln -sfn $(abspath ../shared) .mutmut/shared
	cd .mutmut && PATH=$(CURDIR)/$(BIN):$$PATH HYPOTHESIS_PROFILE=ci nice -n 15 mutmut run --max-children $(MUTMUT_CHILDREN) $(MUTANTS)
	cd .mutmut && $(CURDIR)/$(PY) $(CURDIR)/.ci/mutmut_score.py
	cd .mutmut && $(CURDIR)/$(PY) $(CURDIR)/.ci/mutmut_survivors.py

bench: install browser
	$(PY) -m pip install --quiet -e '.[bench]' || echo "bench extras unavailable: peers will be skipped"
	$(PY) bench/run.py
	$(PY) bench/console.py
	$(PY) bench/load.py
	$(PY) bench/memory.py
	$(PY) bench/send_watch.py

diagrams: install
	$(BIN)/relayline diagram

# ruff, then the layers ([tool.importlinter] in pyproject.toml, docs/architecture.md)
lint: install
	$(BIN)/ruff check machines adapters tests bench examples
	$(BIN)/lint-imports --no-logo --cache-dir $(VENV)/.import_linter_cache

# mypy resolves `relayline.*` through a symlinked view of the source folders (the editable
# install's import hook is invisible to it)
TYPEVIEW := $(VENV)/typecheck
typecheck: install
	mkdir -p $(TYPEVIEW)/relayline
	for p in adapters machines specs; do ln -sfn $(CURDIR)/$$p $(TYPEVIEW)/relayline/$$p; done
	MYPYPATH=$(TYPEVIEW):examples $(BIN)/mypy -p relayline.adapters -m fastapi_app -m sync_script
	$(BIN)/mypy  # machines/, strict ([tool.mypy] in pyproject.toml)

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .hypothesis .mutmut tests/agent_clients/node_modules
