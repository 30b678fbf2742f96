"""One bounded HTTP GET of a pod's metrics page: in time, in size, without redirects or compression.

The whole exchange (connect, headers, body) must finish within ``seconds``; the body is read in
chunks and the read stops as soon as it passes ``max_bytes`` (``TooLarge``: a page of 10 MiB costs
the agent at most ``max_bytes`` and one chunk more, never the whole page). Compressed answers are
refused rather than inflated (an inflated page has no size the cap could hold to), so the request
asks for none.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from gpuwarden.agent.scrape.compact import ScrapeFailed
from gpuwarden.wire.scrape import ScrapeFailure

__all__ = ["DEFAULT_MAX_BYTES", "Page", "fetch"]

DEFAULT_MAX_BYTES = 1024 * 1024
"""A metrics page larger than this is refused (vLLM's is about 60 kB)."""
CHUNK = 64 * 1024

# The text format only, whatever else a server offers: prometheus_client (vLLM's exposition, and our
# simulated server's) ignores q-values and answers OpenMetrics whenever it is named, escaping vLLM's
# colons to underscores (``vllm_num_requests_running``), so the wanted names would never match.
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"
HEADERS = {"Accept": ACCEPT, "Accept-Encoding": "identity", "User-Agent": "gpuwarden-agent"}


@dataclass(frozen=True, slots=True)
class Page:
    """A metrics page as read: its text and its Content-Type."""

    text: str
    content_type: str


async def fetch(session: aiohttp.ClientSession, url: str, *, seconds: float, max_bytes: int) -> Page:
    """GET ``url`` within ``seconds`` (see the module doc); :class:`ScrapeFailed` says why not."""
    try:
        async with asyncio.timeout(seconds):
            async with session.get(url, headers=HEADERS, allow_redirects=False) as response:
                if response.status != 200:
                    raise ScrapeFailed(ScrapeFailure.HTTP_STATUS, f"HTTP {response.status}")
                encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise ScrapeFailed(ScrapeFailure.NOT_PROMETHEUS, f"Content-Encoding {encoding[:40]}")
                length = response.content_length
                if length is not None and length > max_bytes:
                    raise ScrapeFailed(ScrapeFailure.TOO_LARGE, f"Content-Length {length} > {max_bytes}")
                body = await _read_capped(response.content, max_bytes)
                content_type = response.headers.get("Content-Type", "")
    except TimeoutError:
        raise ScrapeFailed(ScrapeFailure.TIMEOUT, f"no complete answer within {seconds:g} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise ScrapeFailed(ScrapeFailure.UNREACHABLE, f"{type(exc).__name__}: {exc}"[:200]) from None
    try:
        return Page(body.decode("utf-8"), content_type)
    except UnicodeDecodeError:
        raise ScrapeFailed(ScrapeFailure.NOT_PROMETHEUS, "the body is not UTF-8") from None


async def _read_capped(stream: aiohttp.StreamReader, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await stream.read(CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise ScrapeFailed(ScrapeFailure.TOO_LARGE, f"more than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
