"""gpuwarden.operator.endpoints."""
