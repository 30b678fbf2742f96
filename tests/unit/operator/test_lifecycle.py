"""The operator's servers: a renewed serving certificate is picked up without a restart."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from tls_support import SERVICE_NAME, make_pki

from gpuwarden.operator.lifecycle import reload_certificate


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
