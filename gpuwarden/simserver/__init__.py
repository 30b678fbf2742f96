"""gpuwarden.simserver: ``gpuwarden sim-server``, the simulated inference replica behind real HTTP.

:mod:`gpuwarden.sim.replica`'s queueing model (a pure function of its caller's clock) served in
real time, as a vLLM server would be: ``POST /v1/completions`` answered once the model says the
request is done, ``GET /metrics`` with real ``prometheus_client`` histograms, gauges and a counter
under vLLM's names and bucket bounds. It is a workload for tests and demos (a pod of our agent
image runs it), not a part of the agent or the operator; nothing of gpuwarden imports it but the
command line.

:mod:`~gpuwarden.simserver.server` is the app (:class:`~gpuwarden.simserver.server.SimServer`,
:func:`~gpuwarden.simserver.server.build_app`); :mod:`~gpuwarden.simserver.command` its flags.
"""

__all__ = ["command", "server"]
