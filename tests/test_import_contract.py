"""The layering of ARCHITECTURE.md, enforced on the source (an import-linter equivalent).

- snapshotter.formats imports none of trio, httpx, pyfuse3, grpc, socket (pure: bytes in, objects out);
- snapshotter.snapshots imports no format, fetch, cache or FUSE code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "snapshotter"

CONTRACTS = {
    "formats": {"trio", "httpx", "pyfuse3", "grpc", "socket", "snapshotter.fetch", "snapshotter.cache",
                "snapshotter.fusefs", "snapshotter.daemon", "snapshotter.snapshots"},
    "snapshots": {"trio", "httpx", "pyfuse3", "snapshotter.formats", "snapshotter.fetch", "snapshotter.cache",
                  "snapshotter.fusefs"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(CONTRACTS))
def test_package_respects_import_contract(package: str) -> None:
    files = sorted((PKG / package).rglob("*.py"))
    assert files, f"no modules found under snapshotter/{package}"
    violations = []
    for f in files:
        for name in _imports(f):
            for banned in CONTRACTS[package]:
                if name == banned or name.startswith(banned + "."):
                    violations.append(f"{f.relative_to(PKG.parent)} imports {name}")
    assert not violations, "\n".join(violations)


# What a process that only reads layers must not load (memory: each process imports its code once
# and keeps it; peak RSS of the daemon plus a mount is a benchmark target). The daemon resolves
# layers and collects cache garbage without the reader; neither process writes layers.
NOT_LOADED = {
    "snapshotter.daemon": {"snapshotter.reader.layer", "snapshotter.formats.estargz_writer",
                           "snapshotter.formats.rafs_writer"},
    "snapshotter.fusefs.process": {"snapshotter.formats.estargz_writer", "snapshotter.formats.rafs_writer"},
}


@pytest.mark.parametrize("entry", sorted(NOT_LOADED))
def test_a_reading_process_does_not_load_what_it_never_runs(entry: str) -> None:
    code = (f"import sys, {entry}\n"
            f"print(sorted(m for m in {sorted(NOT_LOADED[entry])!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=PKG.parent, check=True).stdout
    assert out.strip() == "[]", f"importing {entry} loads {out.strip()}"
