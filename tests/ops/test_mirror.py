"""P2P / mirrors: a registry mirror (the distribution registry in pull-through `proxy` mode) in
front of the origin, configured in containerd's hosts.toml format, serves the lazy Range reads
of a mount; when the mirror dies, reads continue from the origin.

The origin's access log tells our requests (User-Agent snapshotter/...) from the mirror's
pull-through fetches (the registry's own agent).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration import images
from integration.lab import Lab
from tests.fetch.registry import RegistryProcess, start_registry

pytestmark = pytest.mark.integration

BIG = 9 * 1024 * 1024 + 321  # three 4 MiB chunks
_KV = re.compile(r'(\S+?)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass
class Env:
    lab: Lab
    mirror: RegistryProcess
    ref: str
    big_layer: str


def blob_gets(log: Path, digest: str) -> list[dict[str, str]]:
    """The registry's "response completed" records of GETs of blob `digest`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if 'msg="response completed' not in line:
            continue
        kv = {k: v.strip('"') for k, v in _KV.findall(line)}
        uri = kv.get("http.request.uri", "").split("?", 1)[0]  # mirrors get ?ns=REGISTRY
        if kv.get("http.request.method") == "GET" and uri.endswith(f"/blobs/{digest}"):
            out.append(kv)
    return out


def ours(records: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for r in records if r.get("http.request.useragent", "").startswith("snapshotter/")]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("mirror")
    hosts = work / "hosts"
    config = work / "config.toml"
    # No background fill: it would fetch the rest of the layer from the mirror before we kill it.
    config.write_text(f'[registry]\nconfig_path = "{hosts}"\n[prefetch]\nbackground = false\n')
    with Lab(daemon_config=config) as lab:
        mirror = start_registry(work / "mirror", proxy_remote=f"http://{lab.registry_host}")
        try:
            d = hosts / lab.registry_host
            d.mkdir(parents=True)
            # containerd's format: mirrors are tried in order, then the server.
            (d / "hosts.toml").write_text(
                f'server = "http://{lab.registry_host}"\n\n'
                f'[host."http://{mirror.host}"]\n'
                '  capabilities = ["pull", "resolve"]\n')
            layers, _expect = images.foundation_layers()
            big: list[images.Entry] = [images.Dir("data"),
                                       images.File("data/big.bin", images.deterministic_bytes(BIG, seed=5))]
            img = images.build_image(lab.dir / "oci", "mirr", [*layers, big])
            gzip_ref = lab.push(img, "mirr")
            ref = lab.push_converted(gzip_ref, f"{lab.registry_host}/mirr:esgz")
            manifest_layers = _layers(lab, "mirr", "esgz")
            big_layer = max(manifest_layers, key=lambda x: int(str(x["size"])))
            yield Env(lab, mirror, ref, str(big_layer["digest"]))
        finally:
            mirror.stop()


def _layers(lab: Lab, repo: str, tag: str) -> list[dict[str, object]]:
    import json
    import urllib.request

    req = urllib.request.Request(f"http://{lab.registry_host}/v2/{repo}/manifests/{tag}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        layers: list[dict[str, object]] = json.load(r)["layers"]
    return layers


def _upper_file(lab: Lab, container: str, name: str) -> str:
    deadline = time.monotonic() + 60
    while True:
        mounts = lab.ctr("snapshots", "--snapshotter", "lazy", "mounts", "/x", container).stdout
        m = re.search(r"upperdir=([^,\s]+)", mounts)
        assert m, mounts
        path = Path(m.group(1), name)
        if path.exists() and path.read_text().strip():
            return path.read_text()
        assert time.monotonic() < deadline, f"{name} never appeared in {container}"
        time.sleep(0.2)


def _unexplained_origin_requests(env: Env, origin_log: Path) -> str:
    """'' when no request of ours for the big layer reached the origin, or when each could
    follow a failed mirror attempt: the client goes on to the server only after one, and logs
    it (the daemon for resolves, a mount process for reads). Otherwise what the test saw."""
    to_origin = ours(blob_gets(origin_log, env.big_layer))
    if not to_origin:
        return ""
    logs = env.lab.daemon_log() + "".join(
        p.read_text(errors="replace") for p in (env.lab.snapshotter_root / "mounts").glob("*/log"))
    failures = [line for line in logs.splitlines()
                if f"{env.mirror.host} (mirror for" in line and "level=warning" in line]
    if len(failures) >= len(to_origin):
        return ""
    return f"{len(to_origin)} requests reached the origin, {len(failures)} mirror failures logged:\n" + \
        "\n".join(failures) + "\n" + env.lab.daemon_log()[-4000:]


def test_mirror_serves_lazy_reads_and_origin_takes_over_when_it_dies(env: Env) -> None:
    lab, mirror = env.lab, env.mirror
    origin_log = lab.logs_dir / "registry.log"
    lab.rpull(env.ref)
    # The daemon resolved the layer (footer + TOC) through the mirror, not the origin.
    assert ours(blob_gets(mirror.log_path, env.big_layer)), "the mirror should have served the resolve"
    unexplained = _unexplained_origin_requests(env, origin_log)
    assert not unexplained, unexplained

    data = images.deterministic_bytes(BIG, seed=5)
    # One small read in the middle chunk: a single FUSE read, so no read-ahead pulls in the rest.
    head_sum = hashlib.sha256(data[5 << 20:(5 << 20) + 4096]).hexdigest()
    before = len(ours(blob_gets(mirror.log_path, env.big_layer)))
    lab.ctr_run(env.ref, "mirror-reader", "sh", "-c", "dd if=/data/big.bin bs=4096 skip=1280 count=1 2>/dev/null"
                " | sha256sum > /head.txt; sleep 120", detach=True)
    try:
        assert _upper_file(lab, "mirror-reader", "head.txt").split()[0] == head_sum
        reads_via_mirror = ours(blob_gets(mirror.log_path, env.big_layer))[before:]
        assert reads_via_mirror, "the mount's first read should have gone to the mirror"
        assert all(r.get("http.response.status") in ("200", "206") for r in reads_via_mirror)
        unexplained = _unexplained_origin_requests(env, origin_log)
        assert not unexplained, f"the origin served a read the mirror should have: {unexplained}"

        mirror.stop()  # the mirror dies; the mount process (same image, same mount) keeps reading
        out = lab.ctr_run(env.ref, "after-mirror", "sha256sum", "/data/big.bin", timeout=120).stdout
        assert out.split()[0] == hashlib.sha256(data).hexdigest()
        from_origin = ours(blob_gets(origin_log, env.big_layer))
        assert from_origin, "after the mirror died the reads should come from the origin"
        assert all(r.get("http.response.status") == "206" for r in from_origin), from_origin
    finally:
        lab.ctr("tasks", "kill", "-s", "SIGKILL", "mirror-reader", check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "mirror-reader" in lab.ctr("tasks", "ls", "-q").stdout:
            lab.ctr("tasks", "delete", "mirror-reader", check=False)
            time.sleep(0.2)
        lab.ctr("containers", "delete", "mirror-reader", check=False)
