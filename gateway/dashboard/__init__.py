"""The dashboard's numbers: the per-second sampler of each process and the points it merges across processes."""
