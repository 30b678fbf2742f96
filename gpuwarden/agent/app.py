"""The running agent. :func:`build_agent` is its composition root: on an opened backend it wires the
sampler, attribution, training hooks, the report sender and the pods' scrapes into the HTTP server's
app, each opened and closed by the app's ``cleanup_ctx``; :func:`serve` runs that app until SIGTERM or
SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuwarden.agent.attribution import (
    CgroupReader,
    DraResolver,
    NodePods,
    PodAttributor,
    PodResourcesClient,
    ResourceSlices,
    ResourceSlicesError,
    SlicesState,
)
from gpuwarden.agent.backend import DeviceBackend
from gpuwarden.agent.config import AgentConfig
from gpuwarden.agent.hookchannel import HookChannel, hook_channel, open_hook_channel
from gpuwarden.agent.hookrelay import HookRelay
from gpuwarden.agent.http import CleanupContext, background_task, build_app, listen, stale_after
from gpuwarden.agent.metrics import (
    AgentMetrics,
    DraMetrics,
    PodResourcesCollector,
    ScrapeMetrics,
    build_registry,
)
from gpuwarden.agent.nvml import nvml_mig_devices, nvml_minor_numbers
from gpuwarden.agent.scrape import ListedPod, Scraper
from gpuwarden.agent.sender import ReportSender
from gpuwarden.agent.snapshots import Attributor, Sampler, SnapshotRing
from gpuwarden.wire.node import Snapshot

log = logging.getLogger("gpuwarden.agent")


@dataclass(frozen=True, slots=True)
class _Clients:
    """What the agent talks to for attribution: the kubelet, and the API server for the node's pods and
    ResourceSlices (None: not wanted, or no API token). Opened lazily; closed by :func:`_closing`."""

    pod_resources: PodResourcesClient | None = None
    pods: NodePods | None = None
    slices: ResourceSlices | None = None


def _clients(config: AgentConfig) -> _Clients:
    if config.attribution != "kubelet":
        return _Clients()
    return _Clients(
        PodResourcesClient(config.pod_resources_socket, dra_drivers=config.dra_drivers),
        # None outside a cluster or without an API token: PodResources alone then (logged by NodePods).
        NodePods.in_cluster(config.node),
        # None without an API token: DRA devices then resolve by name only (logged).
        ResourceSlices.in_cluster(config.node) if config.dra_drivers and config.dra_resource_slices else None,
    )


def _closing(clients: _Clients) -> CleanupContext:
    async def context(app: web.Application) -> AsyncIterator[None]:
        yield
        for client in (clients.pod_resources, clients.pods, clients.slices):
            if client is not None:
                try:
                    await client.close()
                except Exception as exc:
                    log.warning("closing %s: %s", type(client).__name__, exc)

    return context


def _attributor(
    config: AgentConfig, backend: DeviceBackend, clients: _Clients, dra: DraResolver | None = None
) -> Attributor:
    if config.attribution == "scenario":
        # Loaded already (whoever built the backend imported it); here for the reason given
        # in open_backend.
        from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend

        assert isinstance(backend, ScriptedBackend)  # open_backend opened it from this config
        return ScenarioAttributor(backend)
    assert clients.pod_resources is not None  # _clients opened it for kubelet attribution
    return PodAttributor(
        clients.pod_resources,
        cgroups=CgroupReader(config.proc_root, config.cgroup_root),
        pod_lookup=clients.pods,
        dra=dra,
    )


def _listed(pods: NodePods | None, uid: str) -> ListedPod | None:
    """The pod of ``uid`` as this node's pod list has it: what a scrape target is held to."""
    found = pods.addresses(uid) if pods is not None else None
    if found is None:
        return None  # without a pod list (no API token) no target is scraped
    ref, ips = found
    return ListedPod(ref.namespace, ref.name, ips)


def _dra(config: AgentConfig, slices: ResourceSlices | None, registry: CollectorRegistry) -> DraResolver:
    def slices_state() -> SlicesState:
        return slices.state if slices is not None else SlicesState.NOT_LISTED

    return DraResolver(
        slices,
        # Minor numbers and MIG placements are the real GPUs'; a scripted backend has none to offer.
        minor_numbers=nvml_minor_numbers if config.backend == "nvml" else None,
        mig_devices=nvml_mig_devices if config.backend == "nvml" else None,
        on_unresolved=DraMetrics(registry, slices_state).count_unresolved,
    )


def _first_refresh(
    config: AgentConfig, attributor: Attributor, slices: ResourceSlices | None, metrics: AgentMetrics
) -> CleanupContext:
    async def context(app: web.Application) -> AsyncIterator[None]:
        if slices is not None:
            # Before the first refresh, so that DRA devices resolve from the start instead of being
            # counted as unresolvable while the watch (a background task) lists.
            with contextlib.suppress(
                ResourceSlicesError, TimeoutError
            ):  # logged by list(); the watch retries
                await asyncio.wait_for(slices.list(), timeout=max(5.0, config.attribution_interval))
        try:
            # Allocations first, so that the first snapshot already carries pod names.
            await asyncio.wait_for(attributor.refresh(), timeout=max(5.0, config.attribution_interval))
        except Exception as exc:
            log.warning(
                "first attribution refresh failed (%s); retrying every %ss", exc, config.attribution_interval
            )
            metrics.error("attribution")
        yield

    return context


def _hooks_open(channel: HookChannel, relay: HookRelay | None) -> CleanupContext:
    async def context(app: web.Application) -> AsyncIterator[None]:
        async with open_hook_channel(channel, who="agent", complain=log.error) as hooks:
            if hooks is not None:
                log.info("training hooks connect to %s", hooks.path)
            yield
            if relay is not None:
                await relay.close()

    return context


def build_agent(
    config: AgentConfig, backend: DeviceBackend, *, on_exit: Callable[[str, BaseException | None], None]
) -> web.Application:
    """The agent on an opened backend, as an app: /metrics and the probes, with everything the agent
    opens and runs in its ``cleanup_ctx`` (started in order when the app starts, stopped in reverse).

    ``on_exit(name, error)`` is called if a background task ends on its own (see
    :func:`~gpuwarden.agent.http.background_task`).
    """
    ring = SnapshotRing.lasting(config.sample_interval)
    registry, metrics = build_registry(ring, backend=backend.name, node=config.node)
    clients = _clients(config)
    dra = (
        _dra(config, clients.slices, registry)
        if config.attribution == "kubelet" and config.dra_drivers
        else None
    )
    attributor = _attributor(config, backend, clients, dra)
    if isinstance(attributor, PodAttributor):
        registry.register(PodResourcesCollector(lambda: attributor.pod_resources_state))
    scraper = (
        Scraper(
            lambda uid: _listed(clients.pods, uid),
            ScrapeMetrics(registry),
            concurrency=config.scrape_concurrency,
            timeout=config.scrape_timeout,
        )
        if config.operator_url and config.service_metrics
        else None
    )
    channel = hook_channel(config.hook_socket, registry) if config.hook_socket is not None else None
    # The operator's asks to the hooks of this node's pods (a leak suspected), and their replies.
    relay = (
        HookRelay(channel.server, channel.processes) if channel is not None and config.operator_url else None
    )

    def on_answer(answer: dict[str, Any]) -> None:
        if scraper is not None:
            scraper.accept_plan(answer.get("scrape"))
        if relay is not None:
            relay.accept(answer.get("hookAsks"))

    sender = (
        ReportSender(
            url=config.operator_url,
            node=config.node,
            token_path=config.token_file,
            interval=config.report_interval,
            buffer_limit=config.buffer_limit,
            registry=registry,
            tls=ssl.create_default_context(cafile=config.operator_ca_file),
            server_name=config.operator_server_name,
            on_answer=on_answer,
        )
        if config.operator_url
        else None
    )

    def deliver(snapshot: Snapshot) -> None:
        metrics.count_xids(snapshot)  # XIDs are events: each is counted as its snapshot passes
        if sender is not None:
            # The pods' scrapes and the hooks' replies ride on the next snapshot out (not on the ring's:
            # /metrics is the GPUs').
            extra: dict[str, Any] = {}
            if scraper is not None and (services := scraper.drain()):
                extra["services"] = services
            if relay is not None and (replies := relay.drain()):
                extra["hook_replies"] = replies
            sender.submit(snapshot.model_copy(update=extra) if extra else snapshot)

    def annotate(snapshot: Snapshot) -> Snapshot:
        annotated = attributor.annotate(snapshot)
        if channel is None:
            return annotated
        return channel.processes.observe(channel.stage.annotate(annotated))

    sampler = Sampler(
        backend,
        ring,
        interval=config.sample_interval,
        process_interval=config.process_interval,
        annotate=annotate,
        deliver=deliver,
        events=metrics,
    )

    async def refresh_attribution() -> None:
        while True:
            await asyncio.sleep(config.attribution_interval)
            try:
                await attributor.refresh()
            except Exception:
                log.exception("refreshing pod attribution failed")
                metrics.error("attribution")

    # Started in this order and stopped in reverse: sampling stops first, the sender last, so that
    # what was sampled before SIGTERM still has its chance to go out; the clients close after all.
    contexts = [_closing(clients), _first_refresh(config, attributor, clients.slices, metrics)]
    if channel is not None:
        contexts.append(_hooks_open(channel, relay))
    if sender is not None:
        contexts.append(background_task("sender", sender.run, on_exit=on_exit))
    if scraper is not None:
        contexts.append(background_task("scraper", scraper.run, on_exit=on_exit))
    contexts.append(background_task("attribution", refresh_attribution, on_exit=on_exit))
    if clients.slices is not None:
        contexts.append(background_task("resource slices", clients.slices.run, on_exit=on_exit))
    contexts.append(background_task("sampler", sampler.run, on_exit=on_exit))
    return build_app(registry, ring, stale_after=stale_after(config.sample_interval), background=contexts)


async def serve(
    config: AgentConfig,
    backend: DeviceBackend,
    *,
    listening: Callable[[list[str]], None] | None = None,
) -> int:
    """Run the agent (:func:`build_agent`) until SIGTERM/SIGINT or a background task dies.

    ``listening`` is called with the bound addresses once the HTTP server is up.
    """
    stop = asyncio.Event()
    failed: list[str] = []

    def on_exit(name: str, error: BaseException | None) -> None:
        failed.append(name)
        stop.set()

    app = build_agent(config, backend, on_exit=on_exit)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner: web.AppRunner | None = None
    try:
        runner, addresses = await listen(app, config.host, config.port)
        log.info(
            "agent on node %s, backend %s, listening on %s; reporting to %s",
            config.node,
            backend.name,
            ", ".join(addresses),
            config.operator_url or "nobody",
        )
        if listening is not None:
            listening(addresses)
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if runner is not None:
            await runner.cleanup()
    if failed:
        log.error("stopped because %s ended", ", ".join(failed))
        return 1
    log.info("stopped")
    return 0
