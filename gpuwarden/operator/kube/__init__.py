"""gpuwarden.operator.kube."""
