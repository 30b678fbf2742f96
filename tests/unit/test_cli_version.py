"""One version: pyproject.toml's. The package reports it (``gpuwarden --version``), hack/build-images.sh
stamps it on both images (their tag and ``org.opencontainers.image.version``: tests/integration/
test_images.py), and the chart's ``version`` and ``appVersion`` must say the same, since the chart's
image tags default to its ``appVersion``: a release publishes the images under that tag."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

import gpuwarden
from gpuwarden.cli import main

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_gpuwarden_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"gpuwarden {VERSION}\n"
    assert gpuwarden.__version__ == VERSION


def test_the_chart_and_its_image_tags_carry_the_package_version() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "gpuwarden" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    values = yaml.safe_load((ROOT / "charts" / "gpuwarden" / "values.yaml").read_text())
    # Empty: the tag is the appVersion (_helpers.tpl's gpuwarden.image), never a second copy of it.
    assert values["operator"]["image"]["tag"] == values["agent"]["image"]["tag"] == ""


def test_the_release_publishes_what_the_charts_image_defaults_name() -> None:
    """The workflow's tags and hack/release.sh's layout, with REGISTRY=ghcr.io, are the chart's defaults."""
    chart = yaml.safe_load((ROOT / "charts" / "gpuwarden" / "Chart.yaml").read_text())
    owner = chart["home"].removeprefix("https://github.com/").split("/")[0]
    values = yaml.safe_load((ROOT / "charts" / "gpuwarden" / "values.yaml").read_text())
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    steps = {step.get("name"): step for step in workflow["jobs"]["release"]["steps"]}
    script = (ROOT / "hack" / "release.sh").read_text()
    assert 'target="${REGISTRY}/gpuwarden/gpuwarden-${component}:${VERSION}"' in script
    for component in ("agent", "operator"):
        image = values[component]["image"]
        default = f"{image['registry']}/{image['repository']}"
        tags = steps[f"gpuwarden-{component}"]["with"]["tags"]
        assert tags.replace("${{ github.repository_owner }}", owner).split(":")[0] == default
        assert default == f"ghcr.io/gpuwarden/gpuwarden-{component}"  # release.sh with REGISTRY=ghcr.io
