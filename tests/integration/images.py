"""The container images of the test node, as built by ``hack/build-images.sh --print-env``.

The script builds (only what is missing, into a cache outside the work tree) our agent and
operator images, a locally made ``pause`` image and a workload base image, with podman and
no registry, and prints each as its name and an OCI archive; the node imports archives
into its containerd (:meth:`node.Node.import_image`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from controlplane import REPO_ROOT, BuildError, run_print_env

BUILD_IMAGES_SCRIPT = REPO_ROOT / "hack" / "build-images.sh"
#: A cold build debootstraps the base and pip-installs both images.
BUILD_IMAGES_TIMEOUT_S = 30 * 60


@dataclass(frozen=True)
class Image:
    """An image's reference (``localhost/gpuwarden/...:<key>``) and its OCI archive."""

    name: str
    archive: Path


@dataclass(frozen=True)
class Images:
    """Every image the build script reports, and the chart's values for our two."""

    pause: Image
    workload: Image
    agent: Image
    operator: Image
    registry: str
    agent_tag: str
    operator_tag: str


def locate_images(timeout: float = BUILD_IMAGES_TIMEOUT_S) -> Images:
    """Run ``hack/build-images.sh --print-env`` (builds what is missing).

    Raises :class:`controlplane.BuildError` with the script's output when it fails, does not
    report every image, or reports an archive that is not there.
    """
    prefixes = ("PAUSE", "WORKLOAD", "AGENT", "OPERATOR")
    keys = [
        "IMAGE_REGISTRY",
        "AGENT_IMAGE_TAG",
        "OPERATOR_IMAGE_TAG",
        *(f"{prefix}_{what}" for prefix in prefixes for what in ("IMAGE", "ARCHIVE")),
    ]
    env = run_print_env(BUILD_IMAGES_SCRIPT, keys, timeout)

    def image(prefix: str) -> Image:
        return Image(name=env[f"{prefix}_IMAGE"], archive=Path(env[f"{prefix}_ARCHIVE"]))

    found = Images(
        pause=image("PAUSE"),
        workload=image("WORKLOAD"),
        agent=image("AGENT"),
        operator=image("OPERATOR"),
        registry=env["IMAGE_REGISTRY"],
        agent_tag=env["AGENT_IMAGE_TAG"],
        operator_tag=env["OPERATOR_IMAGE_TAG"],
    )
    every = (found.pause, found.workload, found.agent, found.operator)
    if missing := [str(i.archive) for i in every if not i.archive.is_file()]:
        raise BuildError(f"{BUILD_IMAGES_SCRIPT} succeeded but these archives are missing: {missing}")
    return found
