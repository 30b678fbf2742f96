"""gpuwarden.wire: the versioned contracts between gpuwarden's processes, validated on both ends."""
