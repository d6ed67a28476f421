"""Snapshot metadata, mount computation and the snapshotter service (containerd semantics)."""
