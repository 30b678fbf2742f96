"""The scenario files shipped with gpuwarden, usable by name (``--scenario demo``).

Only the names live here, apart from :mod:`gpuwarden.sim.scenario`, so that the agent
can list them in its ``--help`` without importing the scenario models and YAML, which
only ``--backend scripted`` needs.
"""

PACKAGED = ("demo", "e2e-fast", "shared-gpu")
"""Scenarios shipped in this directory as ``<name>.yaml``."""
