"""The images hack/build-images.sh builds, and `podman run` commands that run them as the chart's pods run.

:func:`locate_images` runs ``hack/build-images.sh --print-env``, which builds what is missing (from a
cold cache: a debootstrapped base, then both images, about four minutes on two cores) and prints each
image's name and OCI archive.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from controlplane import REPO_ROOT, BuildError, run_print_env

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-images.sh"
#: How long the build script may take (a cold cache debootstraps the base and pip-installs both images).
BUILD_TIMEOUT_S = float(os.environ.get("GPUWARDEN_IMAGES_BUILD_TIMEOUT", str(30 * 60)))


@dataclass(frozen=True)
class Image:
    """An image in podman's local storage and the OCI archive of it (``ctr images import``)."""

    name: str
    archive: Path


@dataclass(frozen=True)
class Images:
    """What hack/build-images.sh printed."""

    registry: str
    """``global.imageRegistry`` for the chart."""
    agent: Image
    agent_tag: str
    operator: Image
    operator_tag: str
    pause: Image
    workload: Image
    """A test pod's image (the base): it has a shell and ``sleep``."""


def locate_images(timeout: float = BUILD_TIMEOUT_S) -> Images:
    """Build what is missing and return the images; :class:`BuildError` when that fails."""
    env = run_print_env(BUILD_SCRIPT, timeout)

    def image(key: str) -> Image:
        name, archive = env.get(f"{key}_IMAGE"), env.get(f"{key}_ARCHIVE")
        if not name or not archive:
            raise BuildError(
                f"{BUILD_SCRIPT} --print-env did not report {key}_IMAGE and {key}_ARCHIVE: {env}"
            )
        if not Path(archive).is_file():
            raise BuildError(f"{BUILD_SCRIPT} succeeded but {archive} does not exist")
        return Image(name, Path(archive))

    return Images(
        registry=env.get("IMAGE_REGISTRY", ""),
        agent=image("AGENT"),
        agent_tag=env.get("AGENT_IMAGE_TAG", ""),
        operator=image("OPERATOR"),
        operator_tag=env.get("OPERATOR_IMAGE_TAG", ""),
        pause=image("PAUSE"),
        workload=image("WORKLOAD"),
    )


def podman_run(
    image: str,
    name: str,
    *,
    mounts: Mapping[Path, str] | None = None,
    env: Mapping[str, str] | None = None,
    entrypoint: str | None = None,
) -> list[str]:
    """The ``podman run`` command line of ``image`` (its arguments follow) the way the chart runs its
    containers: a read-only root filesystem with a scratch ``/tmp``, every capability dropped, no
    privilege escalation, the image's own user. ``mounts`` (host path -> container path) are read-only.
    On the host's network: the tests' endpoints are loopback ports, and no CNI is needed.
    """
    argv = [
        "podman", "run", "--rm", f"--name={name}", "--network=host",
        "--read-only", "--read-only-tmpfs=false", "--tmpfs=/tmp",
        "--cap-drop=all", "--security-opt=no-new-privileges",
    ]  # fmt: skip
    for source, target in (mounts or {}).items():
        argv.append(f"--volume={source}:{target}:ro")
    for key, value in (env or {}).items():
        argv.append(f"--env={key}={value}")
    if entrypoint is not None:
        argv.append(f"--entrypoint={entrypoint}")
    return [*argv, image]


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """One podman command, its output captured."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)


def run_once(
    image: str, name: str, *args: str, entrypoint: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``image`` with ``args`` to completion as :func:`podman_run` runs it, its output captured."""
    argv = [*podman_run(image, name, entrypoint=entrypoint), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


@contextmanager
def removed_afterwards(*names: str) -> Iterator[None]:
    """Force-remove these containers on the way out, however the test ended (``--rm`` covers a clean stop)."""
    try:
        yield
    finally:
        for name in names:
            podman("rm", "--force", "--time=0", "--ignore", name)
