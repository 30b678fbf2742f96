"""The chart, the raw manifests and the images, checked without a cluster or a Docker engine.

- the chart's CRDs (and deploy/crds/) are byte-identical copies of crds/;
- every value in values.yaml is documented (a helm-docs ``# --`` comment on it or on a parent) and
  declared in values.schema.json, and the defaults and every ci/ scenario validate against the schema;
- the flags the chart passes are the ones docs/deployment-contract.md lists;
- both Dockerfiles build the wheel and install it through hack/install-runtime.sh, and that script
  really works: it is run for each component against a fresh virtual environment with a wheel built
  from this checkout, and leaves that component's dependencies only.

Rendering, linting and installing the chart need helm and a kube-apiserver:
tests/integration/test_chart.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "gpuwarden"
CRDS = ROOT / "crds"
CONTRACT = ROOT / "docs" / "deployment-contract.md"
INSTALL_SCRIPT = "hack/install-runtime.sh"
DOCKERFILES = {"operator": ROOT / "Dockerfile.operator", "agent": ROOT / "Dockerfile.agent"}

Values = dict[str, Any]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.yaml"))}


# ------------------------------------------------------------------------------ CRDs


def test_top_level_crds_include_gpuwarden_and_kopf_peering() -> None:
    names = {
        doc["metadata"]["name"]
        for path in CRDS.glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    }
    assert {
        "gpumonitorpolicies.gpuwarden.dev",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    } <= names


@pytest.mark.parametrize("path", sorted(CRDS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_crd_file_starts_a_document(path: Path) -> None:
    """`helm show crds` concatenates the chart's CRD files as they are: a file that does not open with
    `---` runs into the one before it, and `kubectl apply` then sees one document whose later keys win."""
    assert path.read_text().startswith("---\n"), path


@pytest.mark.parametrize("copy_dir", ["charts/gpuwarden/crds", "deploy/crds"])
def test_crd_copies_are_identical_to_crds_dir(copy_dir: str) -> None:
    source = _files(CRDS)
    copied = _files(ROOT / copy_dir)
    fix = "hack/sync-chart-crds.sh" if copy_dir.startswith("charts") else "hack/render-manifests.sh"
    assert sorted(copied) == sorted(source), f"{copy_dir} holds other files than crds/: run {fix}"
    stale = [name for name in source if copied[name] != source[name]]
    assert not stale, f"{copy_dir} differs from crds/ in {stale}: run {fix}"


def test_kopf_peering_crds_match_kopf() -> None:
    """Kopf's own definitions: group kopf.dev, v1, status kept as Kopf writes it, no status subresource."""
    docs = {
        d["metadata"]["name"]: d for d in yaml.safe_load_all((CRDS / "kopf.dev_peerings.yaml").read_text())
    }
    assert set(docs) == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    assert docs["clusterkopfpeerings.kopf.dev"]["spec"]["scope"] == "Cluster"
    assert docs["kopfpeerings.kopf.dev"]["spec"]["scope"] == "Namespaced"
    for doc in docs.values():
        (version,) = doc["spec"]["versions"]
        assert version["name"] == "v1"
        assert version["served"]
        assert version["storage"]
        assert "subresources" not in version  # Kopf patches status through the object itself
        schema = version["schema"]["openAPIV3Schema"]
        assert schema["description"]
        status = schema["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True
        assert status["description"]


# ---------------------------------------------------------------------------- values


_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-/]+):(?:\s|$)")


def documented_paths(text: str) -> set[tuple[str, ...]]:
    """Paths of values.yaml keys directly preceded by a comment block that has a ``# --`` line."""
    documented: set[tuple[str, ...]] = set()
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    in_list_item_indent: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped)
            continue
        if not stripped:
            comments = []
            continue
        indent = len(line) - len(line.lstrip(" "))
        if in_list_item_indent is not None and indent > in_list_item_indent:
            comments = []
            continue  # inside a list value: documented with its key
        in_list_item_indent = None
        if stripped.startswith("- "):
            in_list_item_indent = indent - 1
            comments = []
            continue
        match = _KEY_LINE.match(line)
        if match is None:
            comments = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        if any(c.startswith("# --") for c in comments):
            documented.add(tuple(k for _, k in stack))
        comments = []
    return documented


def undocumented(node: Any, path: tuple[str, ...], documented: set[tuple[str, ...]]) -> list[str]:
    """Leaves not covered by a ``# --`` comment on themselves or on a parent."""
    if path in documented:
        return []
    if isinstance(node, dict) and node:
        return [m for key, child in node.items() for m in undocumented(child, (*path, str(key)), documented)]
    return [".".join(path)]


@pytest.fixture(scope="module")
def values_text() -> str:
    return (CHART / "values.yaml").read_text()


@pytest.fixture(scope="module")
def values(values_text: str) -> Values:
    loaded = yaml.safe_load(values_text)
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(loaded)
    return loaded


def test_every_value_is_documented(values_text: str, values: Values) -> None:
    missing = undocumented(values, (), documented_paths(values_text))
    assert not missing, f"values.yaml keys without a `# --` comment (on them or a parent): {missing}"


def test_documentation_check_catches_a_missing_comment() -> None:
    text = "a:\n  # -- documented\n  b: 1\n  c: 2\n# -- whole map\nd:\n  e: 1\n"
    assert undocumented(yaml.safe_load(text), (), documented_paths(text)) == ["a.c"]


def _schema_paths(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, child in node.get("properties", {}).items():
        yield (*path, key)
        yield from _schema_paths(child, (*path, key))


def _value_paths(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict):
        for key, child in node.items():
            yield (*path, key)
            yield from _value_paths(child, (*path, key))


def _open_object(schema: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether the schema lets the object at ``path`` hold any keys (resources, affinity, ...)."""
    node = schema
    for key in path:
        node = node.get("properties", {}).get(key, {})
    return node.get("type") == "object" and "properties" not in node


def test_every_value_is_in_the_schema(values: Values, schema: dict[str, Any]) -> None:
    declared = set(_schema_paths(schema))
    missing = [
        ".".join(p)
        for p in _value_paths(values)
        if p not in declared and not any(_open_object(schema, p[:i]) for i in range(1, len(p)))
    ]
    assert not missing, f"values.yaml keys missing from values.schema.json: {missing}"


def test_schema_documents_every_property(schema: dict[str, Any]) -> None:
    def walk(node: dict[str, Any], path: str) -> Iterator[str]:
        for key, child in node.get("properties", {}).items():
            if "description" not in child:
                yield f"{path}.{key}".lstrip(".")
            yield from walk(child, f"{path}.{key}")

    assert list(walk(schema, "")) == []
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"


def merge_values(base: Values, override: Values) -> Values:
    """Helm's coalescing: maps merge key by key, a null deletes, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))


def test_ci_scenarios_exist() -> None:
    assert {p.name for p in CI_FILES} >= {
        "default-values.yaml",
        "monitoring-enabled-values.yaml",
        "single-namespace-values.yaml",
        "custom-node-selector-values.yaml",
    }


@pytest.mark.parametrize("ci_file", CI_FILES, ids=lambda p: p.name)
def test_ci_scenarios_validate_against_the_schema(
    ci_file: Path, values: Values, schema: dict[str, Any]
) -> None:
    override = yaml.safe_load(ci_file.read_text()) or {}
    jsonschema.validate(merge_values(values, override), schema, cls=jsonschema.Draft7Validator)


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("operator", "replicas"), "abc"),
        (("operator", "replicas"), 0),
        (("agent", "backend"), "cuda"),
        (("agent", "sampleInterval"), "1 second"),
        (("agent", "hook", "hostDir"), "run/gpuwarden"),
        (("agent", "hook", "enabled"), "yes"),
        (("operator", "watchNamespaces"), ["Not_A_Namespace"]),
        (("operator", "rbac", "extraScaleTargets"), [{"apiGroups": ["apps"], "resources": ["deployments"]}]),
        (("operator", "typo"), 1),
        (("monitoring", "prometheusRule", "rules"), {"GPUWardenGPUIdle": {"severity": "page"}}),
        (("monitoring", "prometheusRule", "rules"), {"GPUWardenGPUIdle": {"for": "an hour"}}),
    ],
)
def test_schema_rejects_wrong_values(
    path: tuple[str, ...], bad: Any, values: Values, schema: dict[str, Any]
) -> None:
    broken = copy.deepcopy(values)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema, cls=jsonschema.Draft7Validator)


# -------------------------------------------------------------------------- contract


def contract_flags(section: str) -> set[str]:
    """Flags listed in docs/deployment-contract.md under ``## `gpuwarden <section>` ``."""
    text = CONTRACT.read_text()
    match = re.search(rf"^## `gpuwarden {section}`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no `gpuwarden {section}` section in {CONTRACT}"
    return set(re.findall(r"`(--[a-z][a-z-]*)", match.group(1)))


@pytest.mark.parametrize(
    ("component", "template"),
    [("operator", "templates/operator/deployment.yaml"), ("agent", "templates/agent/daemonset.yaml")],
)
def test_chart_passes_only_contract_flags(component: str, template: str) -> None:
    passed = set(re.findall(r"^\s*- (--[a-z][a-z-]*)", (CHART / template).read_text(), re.M))
    assert passed, f"no flags found in {template}"
    unknown = passed - contract_flags(component)
    assert not unknown, f"{template} passes flags that docs/deployment-contract.md does not list: {unknown}"


def test_contract_names_match_the_chart(values: Values) -> None:
    text = CONTRACT.read_text()
    assert f"`0.0.0.0:{values['operator']['ingest']['port']}`" in text
    assert f"`0.0.0.0:{values['operator']['metrics']['port']}`" in text
    assert f"`0.0.0.0:{values['agent']['port']}`" in text
    assert f"`{values['operator']['ingest']['tokenAudience']}`" in text
    assert "gpuwarden.dev/ingest-active" in (CHART / "templates/operator/service.yaml").read_text()


# ---------------------------------------------------------------------------- images


@pytest.mark.parametrize("component", sorted(DOCKERFILES))
def test_dockerfile_builds_a_wheel_and_uses_the_install_script(component: str) -> None:
    text = DOCKERFILES[component].read_text()
    # The base is a build argument (CI has no registry and passes a local one); users get python:3.12-slim.
    assert re.search(r"^ARG BASE=docker\.io/library/python:3\.12-slim$", text, re.M)
    assert re.findall(r"^FROM .*$", text, re.M) == ["FROM ${BASE} AS builder", "FROM ${BASE}"]
    assert "pip wheel --no-cache-dir --no-deps" in text
    assert re.search(rf"^COPY {re.escape(INSTALL_SCRIPT)} ", text, re.M)
    assert re.search(rf"install-runtime\.sh /wheels {component}\b", text)
    assert 'ENTRYPOINT ["gpuwarden"]' in text
    assert f'CMD ["{component}"]' in text
    for label in ("title", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text


def test_operator_image_runs_as_uid_65532() -> None:
    text = DOCKERFILES["operator"].read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users, "no USER in Dockerfile.operator"
    assert users[-1] == "65532:65532"


def test_agent_image_asks_only_for_nvml() -> None:
    text = DOCKERFILES["agent"].read_text()
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in text
    assert "nvidia/cuda" not in text


def test_dockerignore_lets_the_build_inputs_through() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", ".dockerignore should be an allowlist"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for text in (p.read_text() for p in DOCKERFILES.values()):
        for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
            for source in line.split()[:-1]:
                assert source in allowed, f"{source} is copied but excluded by .dockerignore"


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gpuwarden wheel built from this checkout, as the Dockerfiles' builder stage builds it."""
    wheels = tmp_path_factory.mktemp("wheels")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return wheels


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}


# What each component's command needs that the other's does not: the image of one must not carry it.
_OWN_FRAMEWORK = {"agent": "grpc", "operator": "kopf"}


@pytest.mark.parametrize("component", sorted(DOCKERFILES))
def test_install_script_installs_a_working_runtime(component: str, wheel_dir: Path, tmp_path: Path) -> None:
    """What each image runs, for real: wheel from this checkout, fresh venv, the install script."""
    env = _clean_env()
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(target)
    python = target / "bin" / "python"
    installed = subprocess.run(
        ["bash", str(ROOT / INSTALL_SCRIPT), str(wheel_dir), component],
        capture_output=True,
        text=True,
        env={**env, "PYTHON": str(python)},
        cwd=tmp_path,  # not the checkout: the import must come from the installed wheel
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    version = subprocess.run(
        [str(target / "bin" / "gpuwarden"), "--version"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("gpuwarden ")
    (other,) = set(_OWN_FRAMEWORK) - {component}
    probe = (
        f"import importlib.util, gpuwarden.{component}.command\n"
        "print(gpuwarden.__file__)\n"
        f"print([m for m in ('pip', 'setuptools', {_OWN_FRAMEWORK[component]!r}, {_OWN_FRAMEWORK[other]!r})"
        " if importlib.util.find_spec(m)])"
    )
    where = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, check=False
    )
    assert where.returncode == 0, where.stderr
    location, present = where.stdout.splitlines()
    assert Path(location).is_relative_to(target), location
    # The installers are gone, the component's own framework is there, the other's is not.
    assert present == repr([_OWN_FRAMEWORK[component]])


@pytest.mark.parametrize(
    ("component", "says"),
    [("agent", "exactly one gpuwarden-*.whl"), ("agnet", "unknown component 'agnet'")],
)
def test_install_script_refuses_bad_arguments(tmp_path: Path, component: str, says: str) -> None:
    """An empty wheel directory, a misspelt component: refused with the reason."""
    result = subprocess.run(
        ["bash", str(ROOT / INSTALL_SCRIPT), str(tmp_path), component],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert says in result.stderr
