"""The operator's heap trim: pages the C heap freed go back to the system (glibc)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from tls_support import SERVICE_NAME, make_pki

from gpuwarden.operator.lifecycle import reload_certificate, trim_heap


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_freed_heap_pages_are_returned_to_the_system() -> None:
    # 2 KiB buffers come from glibc's heap (not Python's small-object arenas, not their own mmap);
    # one kept at the top stops glibc from shrinking the heap by itself, as a live store's do.
    buffers = [bytearray(2048) for _ in range(60_000)]
    pin = bytearray(2048)
    held = _rss_mib()
    del buffers
    freed = _rss_mib()
    assert trim_heap()
    trimmed = _rss_mib()
    assert held - freed < 20  # freeing alone gives (almost) nothing back
    assert freed - trimmed > 60  # of the ~120 MiB freed, the trim returns most
    del pin


async def _handshake(port: int, ca: Path) -> bool:
    """Whether a client trusting only ``ca`` completes a TLS handshake with the server on ``port``."""
    context = ssl.create_default_context(cafile=ca)
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=SERVICE_NAME
        )
    except ssl.SSLCertVerificationError:
        return False
    writer.close()
    return True


@pytest.mark.looptime
async def test_a_renewed_certificate_is_served_after_the_next_check(tmp_path: Path) -> None:
    """cert-manager renews in place: the files change under the running server, which picks them up."""
    old = make_pki(tmp_path / "tls")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(old.cert_file, old.key_file)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    reloading = asyncio.create_task(
        reload_certificate(context, str(old.cert_file), str(old.key_file), every=60)
    )
    try:
        await asyncio.sleep(0)  # the task reads the files' times, then waits for its first check
        new = make_pki(tmp_path / "renewed")
        for renewed, path in ((new.cert_file, old.cert_file), (new.key_file, old.key_file)):
            path.write_bytes(renewed.read_bytes())
        assert await _handshake(port, old.ca_file)  # not checked yet: the old certificate still
        await asyncio.sleep(60)  # looptime's fake clock: the first check
        assert await _handshake(port, new.ca_file)
        assert not await _handshake(port, old.ca_file)
    finally:
        reloading.cancel()
        server.close()
