"""gpuwarden.sim: scripted GPUs, a scenario file played as a node's readings and pods at any time."""
