"""gpuwarden.operator.policies."""
