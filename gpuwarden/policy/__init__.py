"""gpuwarden.policy."""
