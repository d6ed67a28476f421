"""Developer tools run as `python -m snapshotter.tools.NAME`."""
