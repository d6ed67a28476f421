"""A containerd remote snapshotter that mounts container images lazily."""

__version__ = "0.1.0"
