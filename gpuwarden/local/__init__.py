"""gpuwarden.local: the policy engine without a cluster (``gpuwarden demo``, ``gpuwarden watch``).

See docs/local-mode.md. :mod:`~gpuwarden.local.session` is the loop both commands share.
"""
