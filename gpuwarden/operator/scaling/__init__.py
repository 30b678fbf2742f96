"""gpuwarden.operator.scaling."""
