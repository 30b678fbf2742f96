# The two commands a newcomer needs: `make demo` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint unit integration control-plane images demo-cluster clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

## demo: play the scripted eight-GPU scenario through the agent and the engine (about a minute)
demo: $(BIN)/.installed
	$(BIN)/gpuwarden demo

## test: lint, type-check, and run every test (unit + integration against a real kube-apiserver, the images and a real node)
test: $(BIN)/.installed control-plane images
	./hack/ensure-system-deps.sh >/dev/null
	$(MAKE) lint
	$(BIN)/pytest -q

# The tests for mypy as pytest imports them: pytest puts each test's folder on sys.path (its default import
# mode), so a test imports its neighbours by bare name (`from test_node import apply`); mypy gets every test
# folder as a base. Each root (unit, integration, gpu) has a `conftest` module of its own: one run per root.
TEST_DIRS := $(shell find tests -name __pycache__ -prune -o -type d -print)
TEST_ROOTS := $(patsubst %/conftest.py,%,$(wildcard tests/*/conftest.py))
empty :=
space := $(empty) $(empty)

## lint: ruff, mypy --strict (the package, then the tests), and the import contracts between the parts
## (pyproject.toml [tool.importlinter])
lint: $(BIN)/.installed
	$(BIN)/ruff check gpuwarden tests bench
	$(BIN)/ruff format --check gpuwarden tests bench
	$(BIN)/mypy
	for root in $(TEST_ROOTS); do MYPYPATH=$(subst $(space),:,$(TEST_DIRS)) $(BIN)/mypy $$root || exit 1; done
	$(BIN)/lint-imports

## demo-cluster: the operator, a scripted agent and the example policy on a throwaway kube-apiserver (~4 min)
demo-cluster: $(BIN)/.installed control-plane
	./hack/demo-cluster.sh

## control-plane: build (once, cached outside the tree) kube-apiserver, etcd, kubectl, helm and the test node's binaries
control-plane:
	./hack/build-control-plane.sh >/dev/null

## images: build with podman (as root; cached outside the tree, rebuilt when their inputs change) the agent,
## operator, pause and base images
images:
	./hack/build-images.sh >/dev/null

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache
