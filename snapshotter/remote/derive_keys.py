"""`python -m snapshotter.remote.derive_keys INDEX_FILE LAYER_DIGEST`: print a stored layer's cache
keys (remote/store.py `dump_keys`), derived from its index or metadata bytes (`load_layer_index`).

The daemon's garbage collection runs this for a live layer that has no cache-keys file yet (its
mount process writes one when it is quiet or stops, and a collection can come first): deriving
the index in the daemon would raise its peak memory for good, some 10 MiB for an 11,000-entry TOC.
Exit status 0 with the keys on stdout; 2 when neither the index nor the metadata bytes are there;
1 for anything else that does not load; the reason on stderr either way.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from snapshotter.errors import SnapshotterError
from snapshotter.remote.store import dump_keys, layer_cache_keys, load_layer_index


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m snapshotter.remote.derive_keys INDEX_FILE LAYER_DIGEST", file=sys.stderr)
        return 1
    index_file, layer_digest = Path(args[0]), args[1]
    try:
        keys = layer_cache_keys(load_layer_index(index_file), layer_digest)
    except FileNotFoundError as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    except (OSError, SnapshotterError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(dump_keys(keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
