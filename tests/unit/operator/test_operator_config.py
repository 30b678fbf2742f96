"""The operator's flags and environment."""

from __future__ import annotations

import pytest

from gpuwarden.operator.config import (
    Address,
    ConfigError,
    OperatorConfig,
    ServiceAccountRef,
    derive_priority,
    parse_address,
)


def parse(*argv: str, env: dict[str, str] | None = None) -> OperatorConfig:
    return OperatorConfig.parse(argv, env or {})


def test_defaults_are_the_contracts() -> None:
    config = OperatorConfig.defaults(
        {"POD_NAME": "gpuwarden-operator-abc", "POD_NAMESPACE": "gpuwarden-system"}
    )
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
    assert config.namespaces == ("a", "b")
    assert not config.clusterwide
    assert config.ingest == Address("::", 9443)
    assert config.max_body_bytes == 2**20
    assert config.priority == 7
    assert config.node_rate == 2.5


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
        (("--peer-ca-file", "ca.crt"), {}, "--peer-ca-file goes with --shards"),
        (("--observe-only", "--node-health", "--cordon=on"), {}, "not with --observe-only"),
        (("--peer-server-name", "op"), {}, "--peer-server-name goes with --shards"),
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


def test_the_fields_defaults_are_the_flags_defaults() -> None:
    """The flags declare the contract's defaults; OperatorConfig() (tests, benchmarks) must not drift."""
    env = {"POD_NAME": "p", "POD_NAMESPACE": "n"}
    config = OperatorConfig.defaults(env)
    assert config == OperatorConfig(
        identity="p", priority=derive_priority("p"), pod_name="p", pod_namespace="n"
    )
