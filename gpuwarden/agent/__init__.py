"""gpuwarden.agent."""
