"""Policy files for local mode: one or more GPUMonitorPolicy documents in one YAML file.

Local mode has no API server, so each document is checked here exactly as the cluster would
check it (:func:`gpuwarden.policy.parse.parse_policy_object` enforces the CRD's schema and CEL
rules). A file may hold several documents (the demo's does: a node-wide hygiene policy and a
serving policy that scales), and each keeps its ``metadata.namespace``:

- in ``gpuwarden demo``, a policy with a namespace judges the pods of that namespace,
  and one without judges every pod (there is no "default" namespace to fall back to);
- in ``gpuwarden watch``, subjects are host processes, which have neither namespace
  nor labels: every policy judges every process (see :func:`for_processes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gpuwarden.policy import LabelSelector, PolicySpec, SpecError, parse_policy_object

DEMO_POLICY = "demo-policy.yaml"
"""The demo's policy file, shipped in ``gpuwarden/local/``."""


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
    documents = _read_documents(path)
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


def _read_documents(path: str | Path) -> list[Any]:
    """The YAML documents of a policy file, empty ones dropped; :class:`SpecError` names the file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError("", f"cannot read policy file: {exc.strerror or exc}", source=source) from exc
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise SpecError("", f"not valid YAML: {exc}", source=source) from exc


def _policy(doc: Any) -> LocalPolicy:
    checked = parse_policy_object(doc)
    return LocalPolicy(name=checked.name, namespace=checked.namespace, spec=checked.spec)


def for_processes(policy: LocalPolicy) -> LocalPolicy:
    """The policy as ``watch`` runs it on host processes: every process judged, nothing scaled.

    Selectors and namespaces speak of pods' labels and namespaces, which host
    processes do not have; keeping them would silently judge nothing. A scale
    action names a Deployment, which a bare host does not have.
    """
    actions = dataclasses.replace(policy.spec.actions, scale=None)
    spec = dataclasses.replace(policy.spec, selector=LabelSelector(), actions=actions)
    return dataclasses.replace(policy, namespace=None, spec=spec)
