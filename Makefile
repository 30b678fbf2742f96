# The two commands a newcomer needs: `make demo` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint crds unit integration control-plane images demo-cluster release clean

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

# The tests and benchmarks for mypy as pytest and python import them: pytest puts each test's folder on
# sys.path (its default import mode), a script its own, so a module imports its neighbours by bare name
# (`from test_node import apply`); mypy gets every such folder as a base (explicit_package_bases). Each test
# root (unit, integration, gpu) has a `conftest` module of its own: one run per root, and one for bench/.
TYPED_DIRS := $(shell find tests -mindepth 1 -name __pycache__ -prune -o -type d -print) bench
TYPED_ROOTS := $(patsubst %/conftest.py,%,$(wildcard tests/*/conftest.py)) bench
empty :=
space := $(empty) $(empty)

## lint: ruff, mypy --strict (the package, then each test root and bench/), and the import contracts
## between the parts (pyproject.toml [tool.importlinter])
lint: $(BIN)/.installed
	$(BIN)/ruff check gpuwarden tests bench
	$(BIN)/ruff format --check gpuwarden tests bench
	$(BIN)/mypy
	status=0; for root in $(TYPED_ROOTS); do \
	  MYPYPATH=$(subst $(space),:,$(TYPED_DIRS)) $(BIN)/mypy $$root || status=1; \
	done; exit $$status
	$(BIN)/lint-imports

## crds: render the CRD's rule-kind parts from the kinds' declarations (gpuwarden/policy/crd.py) and copy
## the CRDs into the chart
crds: $(BIN)/.installed
	$(BIN)/python hack/gen-crd.py

## demo-cluster: the operator, a scripted agent and the example policy on a throwaway kube-apiserver (~4 min)
demo-cluster: $(BIN)/.installed control-plane
	./hack/demo-cluster.sh

## control-plane: build (once, cached outside the tree) kube-apiserver, etcd, kubectl, helm, the test node's binaries and Kueue
control-plane:
	./hack/build-control-plane.sh >/dev/null

## images: build with podman (as root; cached outside the tree, rebuilt when their inputs change) the agent,
## operator, pause and base images
images:
	./hack/build-images.sh >/dev/null

## release: push both images and the chart to REGISTRY (hack/release.sh): make release VERSION=X.Y.Z REGISTRY=HOST
release: control-plane
	./hack/release.sh "$(VERSION)" "$(REGISTRY)"

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache
