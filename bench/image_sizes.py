"""How big the images are: what a node pulls and what it unpacks, per image and per layer.

Not a test: it prints the figures of docs/benchmarks.md ("Images"). It reads the OCI archives
hack/build-images.sh writes, so it needs no registry and no container engine:

    eval "$(hack/build-images.sh --print-env)"
    .venv/bin/python bench/image_sizes.py --base "$BASE_ARCHIVE" \\
        "$BASE_ARCHIVE" "$AGENT_ARCHIVE" "$OPERATOR_ARCHIVE" "$PAUSE_ARCHIVE"

For each archive: the archive file, the layers' compressed size (the gzip blobs a registry serves and a
node pulls) and unpacked size (the tar streams a node stores), in total and for the layers the image
adds over ``--base`` (a layer the base has too is pulled once per node, whatever uses it). With
``--top N``, the largest directories under ``site-packages`` in the added layers: where the bytes go.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

MIB = 1024 * 1024
_SITE_PACKAGES = re.compile(r"(?:^|/)site-packages/([^/]+)")


@dataclass
class Layer:
    """One layer blob of an image."""

    digest: str
    compressed: int
    unpacked: int
    site_packages: Counter[str] = field(default_factory=Counter)


@dataclass
class Image:
    """An image as its OCI archive holds it."""

    name: str
    archive_bytes: int
    layers: list[Layer]


def _blob(archive: tarfile.TarFile, digest: str) -> IO[bytes]:
    member = archive.extractfile("blobs/" + digest.replace(":", "/"))
    if member is None:
        raise ValueError(f"no blob {digest}")
    return member


def _json(archive: tarfile.TarFile, digest: str) -> Any:
    with _blob(archive, digest) as f:
        return json.load(f)


def _unpacked(archive: tarfile.TarFile, digest: str, media_type: str) -> tuple[int, Counter[str]]:
    """Bytes of the layer's tar stream, and of the regular files under each site-packages entry."""
    by_dist: Counter[str] = Counter()
    with _blob(archive, digest) as raw:
        stream: IO[bytes] | gzip.GzipFile = gzip.GzipFile(fileobj=raw) if media_type.endswith("gzip") else raw
        counted = _Counting(stream)
        # typeshed asks any fileobj for write and seek too; a stream ("r|") is only read
        with tarfile.open(fileobj=counted, mode="r|") as layer:  # type: ignore[call-overload]
            for member in layer:
                match = _SITE_PACKAGES.search(member.name)
                if match and member.isfile():
                    by_dist[match[1]] += member.size
        while counted.read(1 << 20):  # the tar's end-of-archive padding counts too
            pass
    return counted.total, by_dist


class _Counting:
    """A read-only stream that counts what is read through it."""

    def __init__(self, inner: IO[bytes] | gzip.GzipFile) -> None:
        self.inner = inner
        self.total = 0

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.total += len(data)
        return data


def read_image(path: Path) -> Image:
    """Every layer of the one image in the OCI archive at ``path``."""
    with tarfile.open(path) as archive:
        index = json.loads(archive.extractfile("index.json").read())  # type: ignore[union-attr]
        (entry,) = index["manifests"]
        manifest = _json(archive, entry["digest"])
        layers = []
        for layer in manifest["layers"]:
            unpacked, by_dist = _unpacked(archive, layer["digest"], layer["mediaType"])
            layers.append(Layer(layer["digest"], layer["size"], unpacked, by_dist))
    name = entry.get("annotations", {}).get("org.opencontainers.image.ref.name", path.name)
    return Image(name, path.stat().st_size, layers)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def main() -> None:
    """Print one table row per archive, then where the added bytes go."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "archives", nargs="+", type=Path, help="OCI archives (podman save --format oci-archive)"
    )
    parser.add_argument("--base", type=Path, help="the base image's archive: its layers are not 'added'")
    parser.add_argument("--top", type=int, default=12, help="largest site-packages entries to list per image")
    args = parser.parse_args()

    base_digests = {layer.digest for layer in read_image(args.base).layers} if args.base else set()
    images = [read_image(path) for path in args.archives]
    print("| image | archive | compressed | unpacked | added compressed | added unpacked |")
    print("| --- | --- | --- | --- | --- | --- |")
    for image in images:
        added = [layer for layer in image.layers if layer.digest not in base_digests]
        print(
            f"| `{image.name}` | {_mib(image.archive_bytes)}"
            f" | {_mib(sum(layer.compressed for layer in image.layers))}"
            f" | {_mib(sum(layer.unpacked for layer in image.layers))}"
            f" | {_mib(sum(layer.compressed for layer in added))}"
            f" | {_mib(sum(layer.unpacked for layer in added))} |"
        )
    for image in images:
        dists: Counter[str] = Counter()
        for layer in image.layers:
            if layer.digest not in base_digests:
                dists.update(layer.site_packages)
        if not dists:
            continue
        print(f"\n{image.name}: site-packages in the added layers, {_mib(sum(dists.values()))} in all")
        for dist, size in dists.most_common(args.top):
            print(f"  {size / MIB:7.2f} MiB  {dist}")


if __name__ == "__main__":
    main()
