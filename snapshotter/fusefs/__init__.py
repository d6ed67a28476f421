"""The per-image FUSE mount: tree merge (tree.py), pyfuse3 Operations (ops.py), process (process.py)."""
