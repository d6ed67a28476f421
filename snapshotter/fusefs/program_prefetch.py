"""The mount process's prefetch of the programs containers are about to run.

When containerd creates a container over a lazily mounted image, the daemon learns the program
the container will run from the container's runtime spec (remote/container_watch.py) and asks
the image's mount process to fetch it: one JSON file per request in the state's "programs_dir"
(runtime_spec.py `Program.to_doc`), then SIGUSR2. The program is the one start-up file that
depends on what the container runs (fusefs/startup_files.py), and runc reads it only after
creating the task, some 100 ms after containerd created the container record: fetched then,
its bytes are cached before the exec reads them, which otherwise waits a registry round trip.

Each request is resolved in the merged tree as runc's lookup would (`program_file`), and the
file's first PROGRAM_MAX_BYTES are fetched like a prefetch (cached, not pinned). A request that
is not a Program, names nothing in the image or fails to fetch is logged and dropped: the
container's own reads fetch what they need either way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from snapshotter.errors import FormatError
from snapshotter.fusefs.startup_files import program_file
from snapshotter.fusefs.tree import MountTree
from snapshotter.reader.units import units
from snapshotter.runtime_spec import Program

log = logging.getLogger(__name__)

PROGRAM_MAX_BYTES = 16 << 20  # of a program's file bytes, from its start: an interpreter is rarely bigger
MAX_REQUESTS = 64  # taken per wake-up; more are left for the next


class ProgramPrefetch:
    """Takes the requests in `directory` (None: none come) and fetches each program through
    `readers` (one per `tree.layers` entry)."""

    def __init__(self, directory: str | None, tree: MountTree, readers: Sequence[Any]) -> None:
        self.directory = Path(directory) if directory else None
        self.tree = tree
        self.readers = readers

    def take(self) -> list[Program]:
        """The pending requests, oldest first, each removed as it is read."""
        if self.directory is None:
            return []
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".json"))[:MAX_REQUESTS]
        except FileNotFoundError:
            return []
        programs = []
        for name in names:
            path = self.directory / name
            try:
                data = path.read_bytes()
                path.unlink()
                programs.append(Program.from_doc(json.loads(data)))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, FormatError) as exc:  # ValueError: not JSON
                log.warning("event=program_request_bad file=%s error=%s", path, exc)
                path.unlink(missing_ok=True)
        return programs

    async def run_pending(self) -> None:
        """Fetch every pending request's program, all at once."""
        programs = self.take()
        if programs:
            async with trio.open_nursery() as nursery:
                for program in programs:
                    nursery.start_soon(self.fetch, program)

    async def fetch(self, program: Program) -> None:
        began = time.monotonic()
        node = program_file(self.tree, program.candidates())
        if node is None or node.entry is None or node.layer is None:
            log.info("event=program_prefetch name=%s status=not_found", program.name)
            return
        path = self.tree.path_of(node)
        reader = self.readers[node.layer]
        if not hasattr(reader, "fetch_chunks"):  # a local blob: nothing to fetch
            return
        chunks = [c for c in units(node.entry, reader.config.unit_bytes)
                  if not c.zeros and c.file_offset < PROGRAM_MAX_BYTES]
        try:
            tally = await reader.fetch_chunks(chunks)
        except Exception as exc:  # only ever an optimization
            log.info("event=program_prefetch name=%s path=%s status=failed error=%r", program.name, path, str(exc))
            return
        log.info("event=program_prefetch name=%s path=%s status=done bytes=%d requests=%d seconds=%.3f",
                 program.name, path, tally.fetched_bytes, tally.requests, time.monotonic() - began)
