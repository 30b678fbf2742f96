"""gpuwarden.local."""
