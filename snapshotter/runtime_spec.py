"""What a container runs, read from its OCI runtime spec (the JSON containerd keeps in the
container's record). Pure: bytes in, a `Program` out.

runc starts a container's process by looking its args[0] up as Go's exec.LookPath does, in the
container, with the process's own environment: a name with a slash is taken as it is (relative
to the process's cwd), a bare name is searched in each PATH directory in turn. `Program` keeps
what that lookup needs, and `candidates` lists the paths it tries, in order, relative to the
image root. A spec without PATH gets containerd's default one (its `oci.WithDefaultPathEnv`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

from snapshotter.errors import FormatError

DEFAULT_PATH: tuple[str, ...] = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
MAX_PATH_DIRS = 64  # a PATH longer than this is cut: each directory costs a lookup in the tree


@dataclass(frozen=True)
class Program:
    """args[0] of a container's process, the PATH directories it is looked up in, and its cwd."""

    name: str
    path: tuple[str, ...] = DEFAULT_PATH
    cwd: str = "/"

    def candidates(self) -> list[str]:
        """The paths the lookup tries, in order, relative to the image root ("usr/bin/true"):
        the name itself when it has a slash, else each PATH directory's entry of that name (an
        empty or relative PATH entry is relative to cwd, as in Go's LookPath)."""
        if "/" in self.name:
            return [_rooted(self.cwd, self.name)]
        seen: list[str] = []
        for directory in self.path[:MAX_PATH_DIRS]:
            candidate = _rooted(self.cwd, posixpath.join(directory or ".", self.name))
            if candidate not in seen:
                seen.append(candidate)
        return seen

    def to_doc(self) -> dict[str, Any]:
        return {"name": self.name, "path": list(self.path), "cwd": self.cwd}

    @classmethod
    def from_doc(cls, doc: object) -> Program:
        """The Program `to_doc` gave; FormatError for anything else."""
        if not isinstance(doc, dict):
            raise FormatError("program: not an object")
        name, path, cwd = doc.get("name"), doc.get("path"), doc.get("cwd")
        if not isinstance(name, str) or not name or "\x00" in name or not isinstance(cwd, str) \
                or not isinstance(path, list) or not all(isinstance(d, str) for d in path):
            raise FormatError(f"program: malformed {str(doc)[:200]!r}")
        return cls(name, tuple(path), cwd or "/")


def _rooted(cwd: str, path: str) -> str:
    """`path` (absolute, or relative to `cwd`) normalized and relative to the image root."""
    joined = posixpath.normpath(posixpath.join("/", cwd or "/", path))
    return joined.lstrip("/")


def program_from_spec(spec: bytes) -> Program | None:
    """The Program of an OCI runtime spec's process, or None when the spec names none (no
    process, no args, an empty args[0]). FormatError when it is not a JSON object."""
    try:
        doc = json.loads(spec)
    except ValueError as exc:
        raise FormatError(f"runtime spec: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FormatError("runtime spec: not a JSON object")
    process = doc.get("process")
    if not isinstance(process, dict):
        return None
    args = process.get("args")
    if not isinstance(args, list) or not args or not isinstance(args[0], str) or not args[0] or "\x00" in args[0]:
        return None
    path: tuple[str, ...] = DEFAULT_PATH
    env = process.get("env")
    if isinstance(env, list):
        for item in env:  # the last PATH wins: runc sets the variables in order
            if isinstance(item, str) and item.startswith("PATH="):
                path = tuple(item[len("PATH="):].split(":"))
    cwd = process.get("cwd")
    return Program(args[0], path, cwd if isinstance(cwd, str) and cwd else "/")
