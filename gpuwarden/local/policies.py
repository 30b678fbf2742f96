"""Policy files for local mode: one or more GPUMonitorPolicy documents in one YAML file.

Local mode has no API server, so the file is checked here exactly as the cluster would
check it (:func:`gpuwarden.policy.parse.parse_spec` enforces the CRD's schema and CEL
rules). Unlike :func:`gpuwarden.policy.parse.load_policy_file`, a file may hold several
documents (the demo's does: a node-wide hygiene policy and a serving policy that
scales), and each keeps its ``metadata.namespace``:

- in ``gpuwarden demo``, a policy with a namespace judges the pods of that namespace,
  and one without judges every pod (there is no "default" namespace to fall back to);
- in ``gpuwarden watch``, subjects are host processes, which have neither namespace
  nor labels: every policy judges every process (see :func:`for_processes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from gpuwarden.policy.model import LabelSelector, PolicySpec
from gpuwarden.policy.parse import API_VERSION, KIND, SpecError, parse_spec, read_policy_documents

DEMO_POLICY = "demo-policy.yaml"
"""The demo's policy file, shipped in ``gpuwarden/local/``."""

_TOP_LEVEL = ("apiVersion", "kind", "metadata", "spec", "status")


@dataclass(frozen=True, slots=True)
class LocalPolicy:
    """One policy as local mode runs it."""

    name: str
    namespace: str | None
    """``metadata.namespace``; None judges every pod."""
    spec: PolicySpec

    @property
    def key(self) -> str:
        """How findings name the policy: ``namespace/name``, or ``name`` without a namespace."""
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


def demo_policy_path() -> Path:
    """The path of the packaged demo policy file."""
    return Path(str(resources.files("gpuwarden.local") / DEMO_POLICY))


def load_policies(path: str | Path) -> list[LocalPolicy]:
    """Read every GPUMonitorPolicy in a YAML file; :class:`SpecError` names the file, document and field."""
    source = str(path)
    documents = read_policy_documents(path)
    if not documents:
        raise SpecError("", "holds no GPUMonitorPolicy", source=source)
    policies: list[LocalPolicy] = []
    for number, doc in enumerate(documents, start=1):
        where = source if len(documents) == 1 else f"{source} (document {number})"
        try:
            policies.append(_policy(doc))
        except SpecError as exc:
            raise SpecError(exc.field, exc.reason, source=where) from None
    keys = [p.key for p in policies]
    duplicate = next((k for k in keys if keys.count(k) > 1), None)
    if duplicate is not None:
        raise SpecError("metadata.name", f"two policies are named {duplicate}", source=source)
    return policies


def _policy(doc: Any) -> LocalPolicy:
    if not isinstance(doc, Mapping):
        raise SpecError("", f"expected a GPUMonitorPolicy object, found {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_TOP_LEVEL))
    if unknown:
        raise SpecError(str(unknown[0]), "unknown field")
    if doc.get("apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"{doc.get('apiVersion')!r} is not {API_VERSION}")
    if doc.get("kind") != KIND:
        raise SpecError("kind", f"{doc.get('kind')!r} is not {KIND}")
    metadata = doc.get("metadata")
    if not isinstance(metadata, Mapping):
        raise SpecError("metadata", "required object is missing")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", "required field is missing")
    namespace = metadata.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise SpecError("metadata.namespace", f"{namespace!r} is not a namespace name")
    if "spec" not in doc:
        raise SpecError("spec", "required field is missing")
    return LocalPolicy(name=name, namespace=namespace, spec=parse_spec(doc["spec"]))


def for_processes(policy: LocalPolicy) -> LocalPolicy:
    """The policy as ``watch`` runs it on host processes: every process judged, nothing scaled.

    Selectors and namespaces speak of pods' labels and namespaces, which host
    processes do not have; keeping them would silently judge nothing. A scale
    action names a Deployment, which a bare host does not have.
    """
    actions = dataclasses.replace(policy.spec.actions, scale=None)
    spec = dataclasses.replace(policy.spec, selector=LabelSelector(), actions=actions)
    return dataclasses.replace(policy, namespace=None, spec=spec)
