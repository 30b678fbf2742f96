"""The running agent: :func:`serve` wires the sampler, attribution, training hooks, the report
sender, the pods' scrapes and the HTTP server on an opened backend, and runs them until SIGTERM or
SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from collections.abc import Callable

from aiohttp import web

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
from gpuwarden.agent.hookattach import HookStage
from gpuwarden.agent.hookcontrol import ControlServer
from gpuwarden.agent.hooksocket import HookReadings, HookServer, HookSocketError
from gpuwarden.agent.http import CleanupContext, background_task, build_app, listen, stale_after
from gpuwarden.agent.metrics import (
    DraMetrics,
    HookMetrics,
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

RING_SECONDS = 300.0
"""How much recent history the agent keeps in memory, whatever the sampling interval."""


class _Closer:
    """What the attributor opened (kubelet channel, API session), closed on the way out."""

    def __init__(self) -> None:
        self.client: PodResourcesClient | None = None
        self.pods: NodePods | None = None
        self.slices: ResourceSlices | None = None

    async def close(self) -> None:
        for closeable in (self.client, self.pods, self.slices):
            if closeable is not None:
                try:
                    await closeable.close()
                except Exception as exc:
                    log.warning("closing %s: %s", type(closeable).__name__, exc)


def _attributor(
    config: AgentConfig, backend: DeviceBackend, closer: _Closer, dra: DraResolver | None = None
) -> Attributor:
    if config.attribution == "scenario":
        # Loaded already (whoever built the backend imported it); here for the reason given
        # in open_backend.
        from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend

        assert isinstance(backend, ScriptedBackend)  # open_backend opened it from this config
        return ScenarioAttributor(backend)
    closer.client = PodResourcesClient(config.pod_resources_socket, dra_drivers=config.dra_drivers)
    # None outside a cluster or without an API token: PodResources alone then (logged by NodePods).
    closer.pods = NodePods.in_cluster(config.node)
    return PodAttributor(
        closer.client,
        cgroups=CgroupReader(config.proc_root, config.cgroup_root),
        pod_lookup=closer.pods,
        dra=dra,
    )


def _listed(closer: _Closer, uid: str) -> ListedPod | None:
    """The pod of ``uid`` as this node's pod list has it: what a scrape target is held to."""
    found = closer.pods.addresses(uid) if closer.pods is not None else None
    if found is None:
        return None  # without a pod list (no API token) no target is scraped
    ref, ips = found
    return ListedPod(ref.namespace, ref.name, ips)


def _dra(config: AgentConfig, closer: _Closer, metrics: DraMetrics) -> DraResolver:
    # None without an API token: DRA devices then resolve by name only (logged).
    closer.slices = ResourceSlices.in_cluster(config.node) if config.dra_resource_slices else None
    return DraResolver(
        closer.slices,
        # Minor numbers and MIG placements are the real GPUs'; a scripted backend has none to offer.
        minor_numbers=nvml_minor_numbers if config.backend == "nvml" else None,
        mig_devices=nvml_mig_devices if config.backend == "nvml" else None,
        on_unresolved=metrics.count_unresolved,
    )


async def serve(
    config: AgentConfig,
    backend: DeviceBackend,
    *,
    listening: Callable[[list[str]], None] | None = None,
) -> int:
    """Run the agent on an opened backend until SIGTERM/SIGINT or a background task dies.

    ``listening`` is called with the bound addresses once the HTTP server is up.
    """
    loop = asyncio.get_running_loop()
    ring = SnapshotRing(capacity=max(1, int(RING_SECONDS / config.sample_interval)))
    registry, metrics = build_registry(ring, backend=backend.name, node=config.node)
    closer = _Closer()
    dra: DraResolver | None = None
    if config.attribution == "kubelet" and config.dra_drivers:

        def slices_state() -> SlicesState:
            return closer.slices.state if closer.slices is not None else SlicesState.NOT_LISTED

        dra = _dra(config, closer, DraMetrics(registry, slices_state))
    attributor = _attributor(config, backend, closer, dra)
    if isinstance(attributor, PodAttributor):
        registry.register(PodResourcesCollector(lambda: attributor.pod_resources_state))
    scraper = (
        Scraper(
            lambda uid: _listed(closer, uid),
            ScrapeMetrics(registry),
            concurrency=config.scrape_concurrency,
            timeout=config.scrape_timeout,
        )
        if config.operator_url and config.service_metrics
        else None
    )
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
            on_plan=scraper.accept_plan if scraper is not None else None,
        )
        if config.operator_url
        else None
    )

    def deliver(snapshot: Snapshot) -> None:
        metrics.count_xids(snapshot)  # XIDs are events: each is counted as its snapshot passes
        if sender is not None:
            # The pods' scrapes ride on the next snapshot out (not on the ring's: /metrics is the GPUs').
            services = scraper.drain() if scraper is not None else []
            sender.submit(snapshot.model_copy(update={"services": services}) if services else snapshot)

    annotate = attributor.annotate
    hooks: HookServer | None = None
    if config.hook_socket is not None:
        readings = HookReadings()
        hook_metrics = HookMetrics(registry, readings, time.time)
        hooks = HookServer(config.hook_socket, readings, events=hook_metrics)
        stage = HookStage(readings, hook_metrics)

        def annotate(snapshot: Snapshot) -> Snapshot:
            return stage.annotate(attributor.annotate(snapshot))

    sampler = Sampler(
        backend,
        ring,
        interval=config.sample_interval,
        process_interval=config.process_interval,
        annotate=annotate,
        deliver=deliver,
        events=metrics,
    )

    stop = asyncio.Event()
    failed: list[str] = []

    def on_exit(name: str, error: BaseException | None) -> None:
        failed.append(name)
        stop.set()

    async def refresh_attribution() -> None:
        while True:
            await asyncio.sleep(config.attribution_interval)
            try:
                await attributor.refresh()
            except Exception:
                log.exception("refreshing pod attribution failed")
                metrics.error("attribution")

    # Started in this order and stopped in reverse: sampling stops first, the sender last,
    # so that what was sampled before SIGTERM still has its chance to go out.
    background: list[CleanupContext] = []
    if sender is not None:
        background.append(background_task("sender", sender.run, on_exit=on_exit))
    if scraper is not None:
        background.append(background_task("scraper", scraper.run, on_exit=on_exit))
    background.append(background_task("attribution", refresh_attribution, on_exit=on_exit))
    if closer.slices is not None:
        background.append(background_task("resource slices", closer.slices.run, on_exit=on_exit))
    background.append(background_task("sampler", sampler.run, on_exit=on_exit))

    if closer.slices is not None:
        # Before the first refresh, so that DRA devices resolve from the start instead of being
        # counted as unresolvable while the watch (started with the other tasks below) lists.
        with contextlib.suppress(ResourceSlicesError, TimeoutError):  # logged by list(); the watch retries
            await asyncio.wait_for(closer.slices.list(), timeout=max(5.0, config.attribution_interval))
    try:
        # Allocations first, so that the first snapshot already carries pod names.
        await asyncio.wait_for(attributor.refresh(), timeout=max(5.0, config.attribution_interval))
    except Exception as exc:
        log.warning(
            "first attribution refresh failed (%s); retrying every %ss", exc, config.attribution_interval
        )
        metrics.error("attribution")

    control: ControlServer | None = None
    if hooks is not None:
        try:
            await hooks.start()
        except HookSocketError as exc:
            # The GPUs' readings matter more than the hooks': run on without them, loudly.
            log.error("%s; training hooks cannot reach this agent", exc)
            hooks = None
        else:
            log.info("training hooks connect to %s", hooks.path)
            control = ControlServer(hooks)
            try:
                await control.start()
            except OSError as exc:
                log.error(
                    "cannot listen on %s (%s); `gpuwarden snapshot` cannot reach this agent",
                    control.path,
                    exc,
                )
                control = None

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner: web.AppRunner | None = None
    try:
        runner, addresses = await listen(
            build_app(registry, ring, stale_after=stale_after(config.sample_interval), background=background),
            config.host,
            config.port,
        )
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
        if control is not None:
            await control.close()
        if hooks is not None:
            await hooks.close()
        await closer.close()
    if failed:
        log.error("stopped because %s ended", ", ".join(failed))
        return 1
    log.info("stopped")
    return 0
