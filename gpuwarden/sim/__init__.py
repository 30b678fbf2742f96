"""gpuwarden.sim: scripted GPUs, a scenario file played as a node's readings, processes and pods.

Others import three modules, the package's public surface:

- :mod:`gpuwarden.sim.scenario`: ``load_scenario``, ``parse_scenario``, ``packaged_scenario``,
  ``Scenario`` (readings, snapshots and pods at any scenario time; ``scale`` for local mode's
  simulated scaling), ``ScenarioError``, ``DEFAULT_ORIGIN``;
- :mod:`gpuwarden.sim.scenarios`: ``PACKAGED``, the names of the scenario files shipped beside it;
- :mod:`gpuwarden.sim.replica`: a simulated inference server replica (``Replica``, ``ReplicaConfig``):
  a FIFO queue and continuous batching played by the caller's clock, exporting vLLM's metrics
  (``ReplicaMetrics``, the metric names, ``HISTOGRAM_BOUNDS``) and a GPU utilization.

The rest is how a scenario is built: :mod:`~gpuwarden.sim.spec` (the file format),
:mod:`~gpuwarden.sim.signals` (deterministic signals), :mod:`~gpuwarden.sim.workloads` (pods,
Deployments and their replicas over time). This ``__init__`` imports none of them, so that the
agent can list ``PACKAGED`` in its ``--help`` without loading the models and YAML that only
``--backend scripted`` needs. The simulator imports only :mod:`gpuwarden.wire` and the units
parser; in the agent, only :mod:`gpuwarden.agent.scripted` uses it (import contracts in
pyproject.toml).
"""

__all__ = ["scenario", "scenarios", "service"]
