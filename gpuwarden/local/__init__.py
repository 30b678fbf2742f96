"""gpuwarden.local: the policy engine without a cluster (``gpuwarden demo``, ``gpuwarden watch``).

See docs/local-mode.md. :mod:`~gpuwarden.local.session` is the loop both commands share; its parts
are :mod:`~gpuwarden.local.subjects` (who a finding is about, and their names),
:mod:`~gpuwarden.local.rows` (what a step shows) and :mod:`~gpuwarden.local.scaler` (simulated
scaling).
"""
