"""A private containerd for tests (root, state and sockets under a temp dir), stopped by PID.

Same approach as tests/formats/test_estargz_interop.py's fixture, shared: `start_containerd(dir)`
returns a `Containerd` whose `ctr()` runs `ctr` / `ctr-remote` against it in namespace `ns`, and
whose `stop()` terminates the process (SIGTERM, then SIGKILL) and unmounts anything left under
its directory. `fs_tree(root)` describes an unpacked/mounted tree for comparisons.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple


@dataclass
class Containerd:
    sock: Path
    root: Path
    dir: Path
    proc: subprocess.Popen[bytes]
    ns: str = "convert-test"

    def ctr(self, *args: str, tool: str = "ctr", timeout: float = 120, check: bool = True) -> str:
        proc = subprocess.run([tool, "-a", str(self.sock), "-n", self.ns, *args], capture_output=True,
                              text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{tool} {' '.join(args)} failed: {proc.stderr}"
        return proc.stdout

    def blob(self, digest: str) -> Path:
        algo, hexpart = digest.split(":")
        return self.root / "io.containerd.content.v1.content" / "blobs" / algo / hexpart

    def manifest(self, ref: str) -> dict[str, Any]:
        for line in self.ctr("images", "ls").splitlines()[1:]:
            cols = line.split()
            if cols and cols[0] == ref:
                doc: dict[str, Any] = json.loads(self.blob(cols[2]).read_bytes())
                return doc
        raise AssertionError(f"image {ref} not in containerd")

    @contextmanager
    def mounted_image(self, ref: str, target: Path) -> Iterator[Path]:
        """`ctr images mount` (unpacks with overlayfs if needed), unmounted + snapshot removed after."""
        target.mkdir(parents=True, exist_ok=True)
        self.ctr("images", "mount", ref, str(target))
        try:
            yield target
        finally:
            self.ctr("images", "unmount", "--rm", str(target), check=False)
            if os.path.ismount(target):
                subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        # overlay/bind mounts containerd made for views we did not clean up
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f]
        for p in reversed(points):
            if p.startswith(str(self.dir) + "/"):
                subprocess.run(["umount", "-l", p], capture_output=True, timeout=60)


def start_containerd(d: Path, *, timeout: float = 30) -> Containerd:
    for tool in ("containerd", "ctr", "ctr-remote"):
        assert shutil.which(tool), f"{tool} is not installed (Debian packages containerd, stargz-snapshotter)"
    config = d / "config.toml"
    config.write_text(f"""version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{d}/c.sock"
[ttrpc]
  address = "{d}/c.ttrpc.sock"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
""")
    with open(d / "containerd.log", "wb") as log:
        proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    ctd = Containerd(sock=d / "c.sock", root=d / "root", dir=d, proc=proc)
    deadline = time.monotonic() + timeout
    try:
        while True:
            ok = subprocess.run(["ctr", "-a", str(ctd.sock), "version"], capture_output=True, timeout=10)
            if ok.returncode == 0:
                return ctd
            assert proc.poll() is None, f"containerd exited: {(d / 'containerd.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"containerd did not answer within {timeout} s"
            time.sleep(0.2)
    except BaseException:
        ctd.stop()
        raise


class Facts(NamedTuple):
    type: str
    mode: int
    uid: int
    gid: int
    mtime: int
    size: int
    link: str
    sha256: str | None


_KIND = {stat.S_IFDIR: "dir", stat.S_IFREG: "reg", stat.S_IFLNK: "symlink", stat.S_IFCHR: "char",
         stat.S_IFBLK: "block", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket"}


def fs_tree(root: Path) -> dict[str, Facts]:
    """{relative name ("" = root): Facts} of a directory tree (hard links appear as regular files)."""
    out: dict[str, Facts] = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        kind = _KIND[stat.S_IFMT(st.st_mode)]
        sha = None
        if kind == "reg":
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while piece := f.read(1 << 20):
                    h.update(piece)
            sha = h.hexdigest()
        out["" if p == root else str(p.relative_to(root))] = Facts(
            kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime),
            st.st_size if kind == "reg" else 0, os.readlink(p) if kind == "symlink" else "", sha)
    return out
