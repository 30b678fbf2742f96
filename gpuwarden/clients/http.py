"""What the clients share: TLS contexts as kubeconfigs and flags give them, and a failure said in one line."""

from __future__ import annotations

import os
import ssl
import tempfile

import aiohttp

__all__ = ["failure", "tls_context"]


def tls_context(
    *,
    ca_file: str | None = None,
    ca_data: bytes | None = None,
    insecure: bool = False,
    cert_file: str | None = None,
    cert_data: bytes | None = None,
    key_file: str | None = None,
    key_data: bytes | None = None,
) -> ssl.SSLContext:
    """A client context: the system's CAs unless a CA is given (PEM, as a file or as data), no
    verification at all when ``insecure``, and a client certificate when one is given."""
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(cafile=ca_file, cadata=None if ca_data is None else ca_data.decode())
    if cert_file or cert_data:
        # ssl loads a certificate chain from files only.
        with tempfile.TemporaryDirectory() as tmp:
            cert = cert_file or _write(os.path.join(tmp, "cert.pem"), cert_data or b"")
            key = key_file or (_write(os.path.join(tmp, "key.pem"), key_data) if key_data else None)
            ctx.load_cert_chain(cert, key)
    return ctx


def _write(path: str, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def failure(exc: BaseException) -> str:
    """Why a request got no answer, in a few words (aiohttp's own text names its connection key and
    SSL context object)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        error = exc.certificate_error
        reason = getattr(error, "verify_message", None) or str(error)
        return f"its TLS certificate is not trusted ({reason})"
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        return f"TLS failed ({getattr(exc.os_error, 'reason', None) or exc.os_error})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
        # asyncio's own strerror names the address again ("Connect call failed ('10.0.0.1', 443)");
        # a name that does not resolve has a negative (getaddrinfo's) errno and its own text.
        errno = error.errno or 0
        return f"unreachable ({os.strerror(errno) if errno > 0 else error.strerror or error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection without an answer"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, aiohttp.InvalidURL):
        return f"not a URL: {exc.url}"
    return str(exc) or type(exc).__name__
