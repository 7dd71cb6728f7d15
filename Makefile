# lmforge: `make demo` runs the pipeline on configs/demo.toml, `make test` runs the tests.
# Both build .venv (and .venv-serve for Triton) first when it is missing; PYTHON=python3.12 builds
# .venv on 3.12 (.venv-serve stays on 3.11: SERVE_PYTHON, see scripts/bootstrap.sh).
# `make wheel` builds dist/lmforge-<version>-py3-none-any.whl (configs, feature repo and prefect.yaml inside).
PY      := .venv/bin/python
CONFIG  ?= configs/demo.toml
PYTEST_ARGS ?=

.PHONY: demo test test-unit lint docs bench bootstrap clean-workspace wheel vllm

.venv/.bootstrapped: pyproject.toml constraints.txt scripts/bootstrap.sh
	bash scripts/bootstrap.sh
	touch $@

bootstrap: .venv/.bootstrapped

demo: .venv/.bootstrapped
	$(PY) -m lmforge.cli run all --config $(CONFIG)

# The tests run on TEST_WORKERS pytest-xdist workers (auto: one per CPU this process may use, as memory allows, at most 4; see
# pytest_xdist_auto_num_workers in tests/conftest.py; TEST_WORKERS=0 runs them in this process). A test file stays on
# one worker (--dist loadfile), so the training runs its module fixtures share are made once. Files go out in
# collection order (--no-loadscope-reorder): xdist's default sends the files with the most tests first, which are the
# quick unit files, and leaves the one-test integration files of a minute or two for the end, where one worker can
# hold several (it takes more while it has 2 tests or fewer pending) while the other has none left; in collection
# order the integration files go first and the unit files fill the end.
# Serial, the suite kept ~1.1 of 2 cores busy (process starts, rendezvous, servers coming up); docs/testing.md.
TEST_WORKERS ?= auto
TEST_DIST    := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: .venv/.bootstrapped
	$(PY) -m pytest $(TEST_DIST) $(PYTEST_ARGS)

# ruff (rules in pyproject.toml [tool.ruff]) and the import contracts of docs/architecture.md ([tool.importlinter])
lint: .venv/.bootstrapped
	.venv/bin/ruff check .
	.venv/bin/lint-imports

# The documentation site (docs/, config scripts/mkdocs.yml) into build/site/. --strict: a broken link or anchor fails it.
# The configuration reference page is generated from components/sections/*.py by the hook scripts/docs_hooks.py.
docs: .venv/.bootstrapped
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -f scripts/mkdocs.yml

# .venv-vllm, vLLM's own Python for [deploy] engine = "vllm" (3.4 GB, ~1 min from the package index; not built by
# demo or test: the vLLM tests skip, naming this target, where it is missing). VLLM_PACKAGE=vllm on a GPU host.
vllm: .venv/.bootstrapped
	LMFORGE_VLLM=1 bash scripts/bootstrap.sh

test-unit: .venv/.bootstrapped
	$(PY) -m pytest $(TEST_DIST) tests/unit $(PYTEST_ARGS)

bench: .venv/.bootstrapped
	$(PY) benchmarks/run_all.py

wheel: .venv/.bootstrapped
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

clean-workspace:
	rm -rf .lmforge
