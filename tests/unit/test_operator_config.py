"""The operator's flags and environment."""

from __future__ import annotations

import argparse

import pytest

from gpuwarden.operator import command
from gpuwarden.operator.config import (
    Address,
    ConfigError,
    ServiceAccountRef,
    build_config,
    default_config,
    derive_priority,
    parse_address,
)


def parse(*argv: str, env: dict[str, str] | None = None) -> object:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    a = parser.parse_args(argv)
    return build_config(
        namespaces=a.namespaces,
        all_namespaces=a.all_namespaces,
        ingest_address=a.ingest_address,
        tls_cert_file=a.tls_cert_file,
        tls_key_file=a.tls_key_file,
        metrics_address=a.metrics_address,
        token_audience=a.token_audience,
        agent_service_account=a.agent_service_account,
        peering=a.peering,
        priority=a.priority,
        max_body_bytes=a.max_body_bytes,
        node_rate=a.node_rate,
        env=env or {},
    )


def test_defaults_are_the_contracts() -> None:
    config = default_config({"POD_NAME": "gpuwarden-operator-abc", "POD_NAMESPACE": "gpuwarden-system"})
    assert config.clusterwide
    assert config.ingest == Address("0.0.0.0", 8443)
    assert config.metrics == Address("0.0.0.0", 8080)
    assert config.token_audience == "gpuwarden-operator"
    assert config.agent_service_account == ServiceAccountRef("gpuwarden-system", "gpuwarden-agent")
    assert config.agent_service_account.username == "system:serviceaccount:gpuwarden-system:gpuwarden-agent"
    assert config.peering == "gpuwarden"
    assert config.max_body_bytes == 2**20
    assert config.node_rate == 20
    assert config.identity == "gpuwarden-operator-abc"
    assert config.priority == derive_priority("gpuwarden-operator-abc")


def test_flags() -> None:
    config = parse(
        "--namespace", "a", "--namespace", "b", "--ingest-address", "[::]:9443", "--max-body-bytes", "1Mi",
        "--priority", "7", "--agent-service-account", "x:y", "--node-rate", "2.5",
        env={"POD_NAME": "p", "POD_NAMESPACE": "n"},
    )  # fmt: skip
    assert config.namespaces == ("a", "b")  # type: ignore[attr-defined]
    assert not config.clusterwide  # type: ignore[attr-defined]
    assert config.ingest == Address("::", 9443)  # type: ignore[attr-defined]
    assert config.max_body_bytes == 2**20  # type: ignore[attr-defined]
    assert config.priority == 7  # type: ignore[attr-defined]
    assert config.node_rate == 2.5  # type: ignore[attr-defined]


def test_priorities_differ_between_replicas_and_stay_across_restarts() -> None:
    names = [f"gpuwarden-operator-7c9f-{s}" for s in ("abcde", "fghij", "klmno")]
    assert len({derive_priority(n) for n in names}) == 3
    assert derive_priority(names[0]) == derive_priority(names[0])
    assert all(1 <= derive_priority(n) < 2**31 for n in names)


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (("--ingest-address", "8443"), {}, "--ingest-address"),
        (("--metrics-address", "x:y"), {}, "--metrics-address"),
        (("--metrics-address", "x:99999"), {}, "out of range"),
        (("--agent-service-account", "noname"), {}, "--agent-service-account"),
        (("--max-body-bytes", "lots"), {}, "--max-body-bytes"),
        (("--max-body-bytes", "0"), {}, "--max-body-bytes"),
        (("--node-rate", "0"), {}, "--node-rate"),
        (("--tls-cert-file", "c.pem"), {}, "--tls-key-file"),
        ((), {"POD_NAME": "p"}, "POD_NAMESPACE"),
    ],
)
def test_errors_name_the_flag(argv: tuple[str, ...], env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse(*argv, env=env)


def test_address_forms() -> None:
    assert parse_address(":80", flag="f") == Address("0.0.0.0", 80)
    assert str(Address("::1", 80)) == "[::1]:80"


def test_bad_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuwarden.cli import main

    assert main(["operator", "--node-rate", "-1"]) == 2
    assert "--node-rate" in capsys.readouterr().err
