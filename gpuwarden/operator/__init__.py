"""gpuwarden.operator."""
