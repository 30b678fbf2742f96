"""gpuwarden.operator.sharding."""
