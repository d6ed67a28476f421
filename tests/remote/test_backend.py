"""Remote prepare against the real registry: lazy layers commit remotely, everything else falls back."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import random
import re
import tarfile
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from snapshotter import metrics
from snapshotter.cache import ChunkCache
from snapshotter.config import Config
from snapshotter.errors import AlreadyExists
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.metadata_parse import MetadataParse, parse_metadata
from snapshotter.formats.rafs_writer import write_nydus
from snapshotter.formats.zstdchunked import write_zstdchunked
from snapshotter.remote import backend as backend_module
from snapshotter.remote import resolver as resolver_module
from snapshotter.remote.backend import RemoteBackend, RemoteLayer
from snapshotter.remote.labels import REMOTE_LABEL, TARGET_SNAPSHOT_REF
from snapshotter.remote.spare_replies import SpareParsed, SpareWait
from snapshotter.remote.store import INDEX_FILE, METADATA_FILE, PARSE_FILE, layer_cache_keys
from snapshotter.runtime_spec import Program
from snapshotter.snapshots.model import Kind
from snapshotter.snapshots.service import Snapshotter
from tests.fetch.registry import RegistryProcess, free_port, push_image
from tests.tars import tar_of


def _estargz(files: dict[str, bytes]) -> tuple[bytes, str]:
    out = io.BytesIO()
    result = write_estargz(io.BytesIO(tar_of(files)), out)
    return out.getvalue(), result.toc_digest


class FakeMounter:
    """Records what the backend asks for; the real one is tested with FUSE in tests/integration."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ensured: dict[str, list[list[RemoteLayer]]] = {}
        self.released: list[str] = []
        self.bare: dict[str, tuple[int, ...]] = {}
        self.ahead: dict[str, bool] = {}
        self.plain_http: dict[str, set[str]] = {}
        self.meta: dict[str, str] = {}  # mount id -> its metadata image's mountpoint, once "built"
        self.direct: dict[str, str] = {}  # mount id -> its direct directory
        self.spare_parses = False  # answer preloads that ask for an answer, as the spare does
        self.pruned = 0  # calls of prune_metadata_images
        self.preloads: list[tuple[MetadataParse, bytes, tuple[str, ...]]] = []  # (parse, data, image layers)
        self.early: list[Mapping[str, Any] | None] = []  # each preload's "early" object
        self.programs: list[tuple[str, dict[str, Any]]] = []  # prefetch_program calls

    def ensure(self, mount_id: str, runs: list[list[RemoteLayer]], *, bare_runs: tuple[int, ...] = (),
               ahead: bool = False, plain_http_hosts: Collection[str] = (),
               auth: Mapping[str, Any] | None = None) -> str:
        self.ensured[mount_id] = runs
        self.ahead[mount_id] = ahead
        self.plain_http[mount_id] = set(plain_http_hosts)
        self.bare[mount_id] = bare_runs
        return str(self.tmp / "mnt" / mount_id)

    def release(self, mount_id: str) -> None:
        self.released.append(mount_id)
        self.ensured.pop(mount_id, None)

    def mounted_ids(self) -> set[str]:
        return set(self.ensured)

    def metadata_dir(self, mount_id: str) -> str | None:
        return self.meta.get(mount_id)

    def direct_dir(self, mount_id: str) -> str | None:
        return self.direct.get(mount_id)

    def prefetch_program(self, mount_id: str, program: Mapping[str, Any]) -> bool:
        self.programs.append((mount_id, dict(program)))
        return True

    def prune_metadata_images(self) -> list[str]:
        self.pruned += 1
        return []

    def preload(self, parse: MetadataParse, data: bytes, key: str, image_layers: tuple[str, ...] = (), *,
                want_answer: bool = False, early: Mapping[str, Any] | None = None) -> SpareWait | None:
        assert key == parse.key(data)
        self.preloads.append((parse, data, image_layers))
        self.early.append(early)
        if not (want_answer and self.spare_parses):
            return None
        # As the spare: parse, answer (remote/spare_replies.py).
        index = parse_metadata(parse, data)
        return lambda _timeout: SpareParsed(index.toc_digest)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[tuple[RemoteBackend, FakeMounter]]:
    config = Config(root=str(tmp_path / "root"), resolve_timeout=5.0)
    sn = Snapshotter(tmp_path / "root")
    mounter = FakeMounter(tmp_path)
    be = RemoteBackend(sn, config, mounter)
    try:
        yield be, mounter
    finally:
        be.close()


def _labels(ref: str, digest: str, target: str, **extra: str) -> dict[str, str]:
    return {TARGET_SNAPSHOT_REF: target, "containerd.io/snapshot/cri.image-ref": ref,
            "containerd.io/snapshot/cri.layer-digest": digest, **extra}


def test_estargz_layer_becomes_remote_snapshot(registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
                                              caplog: pytest.LogCaptureFixture) -> None:
    be, _ = backend
    blob, toc = _estargz({"etc/hello": b"hello\n", "big": b"x" * 100_000})
    image = push_image(registry.url, "lazy/one", "v1", [blob])
    (digest,) = image.layers
    caplog.set_level(logging.INFO)
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, digest, "sha256:chain1",
                                                     **{"containerd.io/snapshot/stargz/toc.digest": toc}))
    info = be.stat("sha256:chain1")
    assert info.kind is Kind.COMMITTED and info.labels[REMOTE_LABEL] == "estargz"
    assert info.labels[TARGET_SNAPSHOT_REF] == "sha256:chain1"
    assert [r.getMessage() for r in caplog.records if "event=lazy_prepare" in r.getMessage()]
    index = be.layers.load(digest)
    assert index.get("etc/hello") is not None and index["big"].size == 100_000
    # The extract key was never created; containerd's metadata layer finds the target by filter.
    found = list(be.walk(['labels."containerd.io/snapshot.ref"==sha256:chain1,parent==""']))
    assert [i.name for i in found] == ["sha256:chain1"]
    # Same layer again (another image or a re-pull): no registry round trip needed, same outcome.
    registry_log = registry.log_path.read_text()
    with pytest.raises(AlreadyExists):
        be.prepare("default/2/extract-2", "sha256:chain1", _labels(image.ref, digest, "sha256:chain2"))
    assert registry.log_path.read_text().count("GET") == registry_log.count("GET")


def test_the_last_layer_of_an_image_is_mounted_ahead(registry: RegistryProcess,
                                                     backend: tuple[RemoteBackend, FakeMounter]) -> None:
    """cri.image-layers names the layers from this one up: a layer naming only itself is the
    image's top, and its mount starts right away (mount_on_pull), marked as started ahead; a
    lower layer's prepare mounts nothing."""
    be, mounter = backend
    blobs = [_estargz({"a": b"a"})[0], _estargz({"b": b"b"})[0]]
    image = push_image(registry.url, "lazy/ahead", "v1", blobs)
    low, top = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, low, "sha256:c1", **{
            "containerd.io/snapshot/cri.image-layers": f"{low},{top}"}))
    time.sleep(0.3)
    assert mounter.ensured == {}
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-2", "sha256:c1", _labels(image.ref, top, "sha256:c2", **{
            "containerd.io/snapshot/cri.image-layers": top}))
    top_id = be.sn.snapshot("sha256:c2").id
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and top_id not in mounter.ensured:
        time.sleep(0.05)
    assert [[layer.layer_digest for layer in run] for run in mounter.ensured[top_id]] == [[low, top]]
    assert mounter.ahead[top_id] is True and mounter.bare[top_id] == (0,)
    # The loopback registry answers plain HTTP only: the mount process is told, so its first
    # read does not try TLS first (as the daemon's first request did).
    assert mounter.plain_http[top_id] == {registry.host}


def _wait_stored(be: RemoteBackend, digests: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(be.layers.meta(d) is not None for d in digests):
        assert time.monotonic() < deadline, f"not resolved ahead within {timeout}s: {digests}"
        time.sleep(0.02)


def test_layers_above_the_one_prepared_are_resolved_ahead(registry: RegistryProcess,
                                                          backend: tuple[RemoteBackend, FakeMounter],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The first layer's Prepare lists the layers above it: they are resolved meanwhile, and their
    own Prepares need no registry request; a TOC digest label is still checked against them."""
    be, mounter = backend
    caplog.set_level(logging.INFO)
    blobs = [_estargz({f"f{i}": bytes([65 + i]) * 1000}) for i in range(3)]
    image = push_image(registry.url, "lazy/three", "v1", [b for b, _ in blobs])
    l1, l2, l3 = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, l1, "sha256:t1", **{
            "containerd.io/snapshot/cri.image-layers": f"{l1},{l2},{l3}"}))
    _wait_stored(be, [l2, l3])
    gets = registry.log_path.read_text().count("GET")
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-2", "sha256:t1", _labels(image.ref, l2, "sha256:t2", **{
            "containerd.io/snapshot/cri.image-layers": f"{l2},{l3}",
            "containerd.io/snapshot/stargz/toc.digest": blobs[1][1]}))
    assert registry.log_path.read_text().count("GET") == gets
    assert be.stat("sha256:t2").kind is Kind.COMMITTED
    # Layer 3's label names another TOC digest than the one stored ahead: resolved again, refused.
    wrong = "sha256:" + "0" * 64
    be.prepare("default/1/extract-3", "sha256:t2", _labels(image.ref, l3, "sha256:t3", **{
        "containerd.io/snapshot/cri.image-layers": l3, "containerd.io/snapshot/stargz/toc.digest": wrong}))
    (line,) = _fallback_lines(caplog)
    assert l3 in line and "reason=toc_digest_mismatch" in line, line
    # Each parse was handed to the spare; only the lowest layer's came with the image's layers.
    handed = [(p.layer_digest, layers) for p, _data, layers in mounter.preloads]
    assert sorted(handed) == sorted([(l1, (l1, l2, l3)), (l2, ()), (l3, ()), (l3, ())]), handed
    for p, data, _layers in mounter.preloads:
        assert parse_metadata(p, data).format == "estargz"
    assert be.layers.meta(l1) is not None and be.layers.meta(l1).parse_key == \
        next(p.key(d) for p, d, _ in mounter.preloads if p.layer_digest == l1)


def test_metadata_the_spare_parsed_is_stored_and_the_daemon_does_not_parse(
        backend: tuple[RemoteBackend, FakeMounter], registry: RegistryProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the spare's parse answered, the daemon stores the layer's metadata bytes, not an index
    (it never parses them: the store derives the index when it is loaded); a TOC digest label is
    checked against the spare's answer, and a mismatch stores nothing."""
    be, mounter = backend
    mounter.spare_parses = True

    def no_daemon_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the daemon parsed what the spare had parsed")

    monkeypatch.setattr(resolver_module, "parse_metadata", no_daemon_parse)
    blob, toc_digest = _estargz({"a.txt": b"spare parsed\n" * 100, "b/c": b"x"})
    image = push_image(registry.url, "lazy/spareparsed", "v1", [blob])
    (layer,) = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, layer, "sha256:sp1", **{
            "containerd.io/snapshot/stargz/toc.digest": toc_digest}))
    p, data, _layers = mounter.preloads[0]
    d = be.layers.layer_dir(layer)
    assert (d / METADATA_FILE).read_bytes() == data and not (d / INDEX_FILE).exists()
    assert json.loads((d / PARSE_FILE).read_text()) == p.to_doc()
    assert be.layers.load(layer) == parse_metadata(p, data)
    meta = be.layers.meta(layer)
    assert meta is not None and meta.toc_digest == toc_digest and meta.parse_key == p.key(data)
    # The same bytes under another layer's label with a wrong TOC digest: refused, nothing stored.
    other = push_image(registry.url, "lazy/spareparsed2", "v1", [_estargz({"z": b"other"})[0]])
    (other_layer,) = other.layers
    be.prepare("default/2/extract-1", "", _labels(other.ref, other_layer, "sha256:sp2", **{
        "containerd.io/snapshot/stargz/toc.digest": "sha256:" + "0" * 64}))
    assert be.layers.meta(other_layer) is None


def _pull_first_of_two(be: RemoteBackend, registry: RegistryProcess, repo: str, tag: str) -> tuple[str, str, str]:
    """Push a two-layer eStargz image and prepare its lower layer only (the upper one is then
    resolved ahead); returns (image ref, lower digest, upper digest) once the upper is stored."""
    blobs = [_estargz({f"{tag}{i}": bytes([70 + i]) * 1000})[0] for i in range(2)]
    image = push_image(registry.url, repo, "v1", blobs)
    low, top = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare(f"default/{tag}/extract-1", "", _labels(image.ref, low, f"sha256:{tag}1", **{
            "containerd.io/snapshot/cri.image-layers": f"{low},{top}"}))
    _wait_stored(be, [top])
    return image.ref, low, top


def _written_for(log_text: str, digest: str) -> list[int]:
    """Body bytes of each GET of blob `digest` in the registry's log."""
    return [int(m.group(1)) for line in log_text.splitlines()
            if "response completed" in line and "http.request.method=GET" in line and f"blobs/{digest}" in line
            for m in [re.search(r"http.response.written=(\d+)", line)] if m]


def test_a_layer_resolved_ahead_asks_for_the_usual_tail_and_logs_its_bytes(
        registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
        caplog: pytest.LogCaptureFixture) -> None:
    """The Prepare's tail-size hint is its own layer's: a layer above, resolved ahead, asks for
    TAIL_BYTES (it used to ask for the hint, 561 KB too many for the bench image's upper layer).
    What it fetched is logged with it, since its own Prepare fetches nothing."""
    be, _mounter = backend
    caplog.set_level(logging.INFO)
    rng = random.Random(7)
    blobs = [_estargz({f"f{i}.bin": rng.randbytes(300_000)}) for i in range(2)]
    image = push_image(registry.url, "lazy/hinted", "v1", [b for b, _ in blobs])
    l1, l2 = image.layers
    hint = 200_000  # more than either layer's footer + TOC, less than either blob
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, l1, "sha256:h1", **{
            "containerd.io/snapshot/cri.image-layers": f"{l1},{l2}",
            "containerd.io/snapshot/lazy/tail.size": str(hint)}))
    _wait_stored(be, [l2])
    log_text = registry.log_path.read_text()
    assert _written_for(log_text, l1) == [hint]
    assert _written_for(log_text, l2) == [resolver_module.TAIL_BYTES]
    (line,) = [r.getMessage() for r in caplog.records if "event=resolved_ahead" in r.getMessage()]
    assert f"layer={l2}" in line and f"fetched_bytes={resolver_module.TAIL_BYTES} " in line, line
    metadata = int(re.search(r"metadata_bytes=(\d+)", line).group(1))  # type: ignore[union-attr]
    assert 0 < metadata < resolver_module.TAIL_BYTES
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-2", "sha256:h1", _labels(image.ref, l2, "sha256:h2", **{
            "containerd.io/snapshot/cri.image-layers": l2}))
    (own,) = [r.getMessage() for r in caplog.records if "event=lazy_prepare" in r.getMessage() and l2 in r.getMessage()]
    assert "fetched_bytes=0 " in own, own


def test_cleanup_keeps_a_layer_resolved_ahead_until_its_prepare(registry: RegistryProcess,
                                                                   backend: tuple[RemoteBackend, FakeMounter]) -> None:
    """containerd sends Cleanup whenever its GC ran, e.g. in the middle of the next pull: an index
    saved ahead of its layer's Prepare (no snapshot refers to it yet) must survive it, or the
    snapshot made next would point at nothing. Unclaimed for longer than the grace, it goes."""
    be, _ = backend
    ref, low, top = _pull_first_of_two(be, registry, "lazy/gc-ahead", "g")
    be.cleanup()
    assert be.layers.meta(top) is not None, "GC dropped an index its Prepare is about to use"
    gets = registry.log_path.read_text().count("GET")
    with pytest.raises(AlreadyExists):
        be.prepare("default/g/extract-2", "sha256:g1", _labels(ref, top, "sha256:g2", **{
            "containerd.io/snapshot/cri.image-layers": top}))
    assert registry.log_path.read_text().count("GET") == gets
    be.cleanup()
    assert be.layers.load(top).get("g1") is not None  # referenced now
    # A pull that stopped after its first layer: the ahead claim expires, the index goes.
    _, low2, top2 = _pull_first_of_two(be, registry, "lazy/gc-ahead2", "h")
    be.claims.ahead_grace = 0.0
    be.cleanup()
    assert be.layers.meta(top2) is None and be.layers.meta(low2) is not None


def test_a_layer_failing_ahead_falls_back_once_on_its_own_prepare(registry: RegistryProcess,
                                                                  backend: tuple[RemoteBackend, FakeMounter],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    be, _ = backend
    caplog.set_level(logging.INFO)
    image = push_image(registry.url, "lazy/mixed", "v1", [_estargz({"a": b"a"})[0], gzip.compress(tar_of({"b": b"b"}))])
    low, plain = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, low, "sha256:m1", **{
            "containerd.io/snapshot/cri.image-layers": f"{low},{plain}"}))
    deadline = time.monotonic() + 10
    while not any("event=resolve_ahead_failed" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the resolve ahead of the plain layer did not end"
        time.sleep(0.02)
    assert _fallback_lines(caplog) == []  # ahead, a failure is only noted
    mounts = be.prepare("default/1/extract-2", "sha256:m1", _labels(image.ref, plain, "sha256:m2", **{
        "containerd.io/snapshot/cri.image-layers": plain}))
    assert mounts and be.stat("default/1/extract-2").kind is Kind.ACTIVE
    (line,) = _fallback_lines(caplog)
    assert plain in line and "reason=not_lazy" in line


def _nydus_layers(salt: bytes) -> list[bytes]:
    """A two-layer Nydus image as the registry holds it: two blob layers, then the bootstrap layer
    (a gzip tar of image/image.boot) last. `salt` makes the layers (and digests) the test's own."""
    blobs: list[io.BytesIO] = []

    def blob_out(_i: int) -> io.BytesIO:
        blobs.append(io.BytesIO())
        return blobs[-1]

    result = write_nydus([io.BytesIO(tar_of({"a": b"a" * 5000 + salt})), io.BytesIO(tar_of({"b": b"b" * 7000 + salt}))],
                         blob_out,
                         chunk_size=4096)
    boot = io.BytesIO()
    with tarfile.open(fileobj=boot, mode="w") as tf:
        info = tarfile.TarInfo("image/image.boot")
        info.size = len(result.bootstrap)
        tf.addfile(info, io.BytesIO(result.bootstrap))
    return [b.getvalue() for b in blobs] + [gzip.compress(boot.getvalue())]


def _gets_of(registry: RegistryProcess, digest: str) -> int:
    """GETs of blob `digest` in the registry's log, once the log has settled (it logs a request
    after answering it)."""
    deadline = time.monotonic() + 3
    size = -1
    while time.monotonic() < deadline and size != (size := registry.log_path.stat().st_size):
        time.sleep(0.3)
    return sum(1 for line in registry.log_path.read_text().splitlines()
               if "method=GET" in line and f"/blobs/{digest}" in line)


def _get_bytes_of(registry: RegistryProcess, digest: str) -> int:
    """Body bytes the registry sent for GETs of blob `digest` (call after `_gets_of`: the log has settled)."""
    return sum(int(m.group(1)) for line in registry.log_path.read_text().splitlines()
               if "method=GET" in line and f"/blobs/{digest}" in line
               and (m := re.search(r"http\.response\.written=(\d+)", line)) is not None)


NYDUS_BLOB_LABEL = {"containerd.io/snapshot/nydus-blob": "true"}
NYDUS_BOOT_LABEL = {"containerd.io/snapshot/nydus-bootstrap": "true"}


def test_a_nydus_bootstrap_is_resolved_ahead_and_used_only_as_a_bootstrap(
        registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
        caplog: pytest.LogCaptureFixture) -> None:
    """The first blob layer's Prepare lists the image's layers: the last one (a Nydus image's
    bootstrap) is fetched and parsed meanwhile, the one between stored as a blob, and their own
    Prepares fetch nothing. A Prepare of the same layer without the bootstrap marker does not
    take the guess: it resolves the layer as what its labels say it is (here: not lazy)."""
    be, _ = backend
    caplog.set_level(logging.INFO)
    image = push_image(registry.url, "lazy/nydus-ahead", "v1", _nydus_layers(b"ahead"))
    b0, b1, boot = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, b0, "sha256:n1", **NYDUS_BLOB_LABEL, **{
            "containerd.io/snapshot/cri.image-layers": f"{b0},{b1},{boot}"}))
    _wait_stored(be, [b1, boot])
    meta_b1, meta_boot = be.layers.meta(b1), be.layers.meta(boot)
    assert meta_b1 is not None and meta_b1.format == "nydus-blob"
    assert meta_boot is not None and meta_boot.format == "nydus"
    assert _gets_of(registry, boot) == 1
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-2", "sha256:n1", _labels(image.ref, b1, "sha256:n2", **NYDUS_BLOB_LABEL, **{
            "containerd.io/snapshot/cri.image-layers": f"{b1},{boot}"}))
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-3", "sha256:n2", _labels(image.ref, boot, "sha256:n3", **NYDUS_BOOT_LABEL, **{
            "containerd.io/snapshot/cri.image-layers": boot}))
    assert be.stat("sha256:n3").labels[REMOTE_LABEL] == "nydus"
    assert be.layers.load(boot).get("b") is not None
    assert _gets_of(registry, boot) == 1, "the bootstrap's own Prepare fetched it again"
    # The same layer, labelled as an ordinary one: the stored Nydus index is not its answer.
    mounts = be.prepare("default/2/extract-1", "", _labels(image.ref, boot, "sha256:plain1"))
    assert mounts and be.stat("default/2/extract-1").kind is Kind.ACTIVE
    (line,) = _fallback_lines(caplog)
    assert boot in line and "reason=not_lazy" in line, line


@pytest.mark.parametrize("first_read", [None, 100])
def test_a_bootstrap_layer_takes_one_get_when_it_fits_the_first_read(
        registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
        monkeypatch: pytest.MonkeyPatch, first_read: int | None) -> None:
    """No HEAD for the size: a suffix read of BOOTSTRAP_FIRST_READ bytes brings a smaller layer
    whole (one round trip); a bigger one gets the rest in a second read, and parses the same."""
    be, _ = backend
    if first_read is not None:
        monkeypatch.setattr(resolver_module, "BOOTSTRAP_FIRST_READ", first_read)
    salt = b"first%d" % (first_read or 0)
    image = push_image(registry.url, f"lazy/nydus-first-{first_read or 0}", "v1", _nydus_layers(salt))
    *_, boot = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, boot, "sha256:f1", **NYDUS_BOOT_LABEL, **{
            "containerd.io/snapshot/cri.image-layers": boot}))
    meta = be.layers.meta(boot)
    assert meta is not None and meta.format == "nydus"
    assert be.layers.load(boot).get("b") is not None
    assert _gets_of(registry, boot) == (1 if first_read is None else 2)
    assert _get_bytes_of(registry, boot) == meta.blob_size
    heads = [line for line in registry.log_path.read_text().splitlines()
             if "method=HEAD" in line and f"/blobs/{boot}" in line]
    assert heads == []


def test_a_guessed_bootstrap_over_the_ahead_cap_waits_for_its_prepare(
        registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A guess is fetched whole only while it is small: over AHEAD_MAX_BOOTSTRAP_BYTES no more of
    it than that is downloaded ahead (the first read, which tells its size; it might be a big
    blob), and its own Prepare resolves it as usual."""
    be, _ = backend
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(backend_module, "AHEAD_MAX_BOOTSTRAP_BYTES", 100)
    image = push_image(registry.url, "lazy/nydus-cap", "v1", _nydus_layers(b"cap")[1:])
    b0, boot = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, b0, "sha256:c1", **NYDUS_BLOB_LABEL, **{
            "containerd.io/snapshot/cri.image-layers": f"{b0},{boot}"}))
    deadline = time.monotonic() + 10
    while not any("event=resolve_ahead_failed" in r.getMessage() and boot in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the resolve ahead of the bootstrap did not end"
        time.sleep(0.02)
    assert _gets_of(registry, boot) == 1 and _get_bytes_of(registry, boot) == 100
    assert be.layers.meta(boot) is None
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-2", "sha256:c1", _labels(image.ref, boot, "sha256:c2", **NYDUS_BOOT_LABEL, **{
            "containerd.io/snapshot/cri.image-layers": boot}))
    assert be.stat("sha256:c2").labels[REMOTE_LABEL] == "nydus" and _fallback_lines(caplog) == []


def _fallback_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "event=fallback" in
            r.getMessage()]


def test_plain_gzip_layer_falls_back(registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
                                     caplog: pytest.LogCaptureFixture) -> None:
    be, _ = backend
    image = push_image(registry.url, "plain/one", "v1", [gzip.compress(tar_of({"a": b"a"}))])
    (digest,) = image.layers
    before = metrics.FALLBACKS.labels("not_lazy")._value.get()
    mounts = be.prepare("default/1/extract", "", _labels(image.ref, digest, "sha256:plain"))
    assert mounts[0].type == "bind"
    assert be.stat("default/1/extract").kind is Kind.ACTIVE
    (line,) = _fallback_lines(caplog)
    assert f"image={image.ref}" in line and f"layer={digest}" in line and "reason=not_lazy" in line
    assert "seconds=" in line
    assert metrics.FALLBACKS.labels("not_lazy")._value.get() == before + 1


def test_registry_down_falls_back_within_timeout(backend: tuple[RemoteBackend, FakeMounter],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    be, _ = backend
    ref = f"127.0.0.1:{free_port()}/gone/image:v1"
    digest = "sha256:" + "ab" * 32
    mounts = be.prepare("default/1/x", "", _labels(ref, digest, "sha256:gone"))
    assert mounts and be.stat("default/1/x").kind is Kind.ACTIVE
    (line,) = _fallback_lines(caplog)
    assert "reason=registry" in line and digest in line
    seconds = float(line.split("seconds=")[1].split()[0])
    assert seconds <= be.config.resolve_timeout + 1


def test_toc_digest_mismatch_falls_back(registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter],
                                        caplog: pytest.LogCaptureFixture) -> None:
    be, _ = backend
    blob, _toc = _estargz({"f": b"data"})
    image = push_image(registry.url, "lazy/two", "v1", [blob])
    (digest,) = image.layers
    be.prepare("default/1/y", "", _labels(image.ref, digest, "sha256:bad",
                                          **{"containerd.io/snapshot/stargz/toc.digest": "sha256:" + "0" * 64}))
    (line,) = _fallback_lines(caplog)
    assert "reason=toc_digest_mismatch" in line
    assert be.layers.meta(digest) is None, "a rejected layer must not be persisted"


def test_no_remote_labels_is_ordinary(backend: tuple[RemoteBackend, FakeMounter],
                                      caplog: pytest.LogCaptureFixture) -> None:
    be, _ = backend
    be.prepare("default/1/z", "", {TARGET_SNAPSHOT_REF: "sha256:plain"})
    assert be.stat("default/1/z").kind is Kind.ACTIVE
    assert not _fallback_lines(caplog)


def test_lowers_interleave_remote_runs_with_local_layers(registry: RegistryProcess,
                                                         backend: tuple[RemoteBackend, FakeMounter]) -> None:
    be, mounter = backend
    blobs = [_estargz({f"f{i}": b"%d" % i})[0] for i in range(3)]
    image = push_image(registry.url, "lazy/mixed", "v1", blobs)
    d = list(image.layers)
    # bottom-up: remote L0, remote L1, local L2, remote L3
    with pytest.raises(AlreadyExists):
        be.prepare("k0", "", _labels(image.ref, d[0], "c0"))
    with pytest.raises(AlreadyExists):
        be.prepare("k1", "c0", _labels(image.ref, d[1], "c1"))
    be.prepare("k2", "c1", {})  # unpacking a local layer over remote ones mounts them
    unpack_mount = be.sn.snapshot("c1").id
    assert unpack_mount in mounter.ensured
    be.commit("c2", "k2", {})
    assert mounter.released == [unpack_mount]
    with pytest.raises(AlreadyExists):
        be.prepare("k3", "c2", _labels(image.ref, d[2], "c3"))
    (m,) = be.prepare("ctr", "c3", {})
    top = be.sn.snapshot("c3").id
    lower = next(o for o in m.options if o.startswith("lowerdir=")).removeprefix("lowerdir=").split(":")
    mnt = str(Path(mounter.tmp, "mnt", top))
    assert lower == [f"{mnt}/1", be.sn.fs_dir(be.sn.snapshot("c2").id), f"{mnt}/0"]
    runs = mounter.ensured[top]
    assert [[layer.layer_digest for layer in run] for run in runs] == [[d[0], d[1]], [d[2]]]
    assert mounter.bare[top] == (0,), "the bottom run has nothing below it"
    # Once the image's metadata image is mounted, runs come from it, over the FUSE mount's data.
    mounter.meta[top] = str(Path(mounter.tmp, "meta", top))
    (m,) = be.mounts("ctr")
    assert "metacopy=on" in m.options
    lower = next(o for o in m.options if o.startswith("lowerdir=")).removeprefix("lowerdir=")
    assert lower == f"{mounter.meta[top]}/1:{be.sn.fs_dir(be.sn.snapshot('c2').id)}:{mounter.meta[top]}/0::{mnt}"
    # With a direct directory (fusefs/direct.py), it is the first data-only layer: it wins.
    mounter.direct[top] = str(Path(mounter.tmp, "direct", top))
    (m,) = be.mounts("ctr")
    lower = next(o for o in m.options if o.startswith("lowerdir=")).removeprefix("lowerdir=")
    assert lower.endswith(f"{mounter.meta[top]}/0::{mounter.direct[top]}::{mnt}")
    be.remove("ctr")
    assert mounter.released == [unpack_mount, top]


def test_cleanup_collects_chunks_and_indexes_no_snapshot_references(
        registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter]) -> None:
    from snapshotter.cache import ChunkCache
    from snapshotter.reader import chunk_key
    from snapshotter.remote.store import blob_digests

    be, _ = backend
    blob, _toc = _estargz({"kept": b"k" * 5000})
    image = push_image(registry.url, "lazy/gc", "v1", [blob])
    (digest,) = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("k1", "", _labels(image.ref, digest, "sha256:gc-chain"))
    index = be.layers.load(digest)
    (kept_chunk,) = index["kept"].chunks
    kept_key = chunk_key(kept_chunk, blob_digests(index, digest))
    stale_key = "sha256:" + "5" * 64
    cache = ChunkCache(be.sn.root / "cache", 1 << 20)
    cache.put(kept_key, b"k" * 5000)
    cache.put(stale_key, b"stale")
    cache.close()
    (be.layers.root / ("6" * 64)).mkdir()  # a layer index nothing refers to any more

    be.cleanup()

    cache = ChunkCache(be.sn.root / "cache", 1 << 20)
    try:
        assert cache.contains(kept_key) and not cache.contains(stale_key)
    finally:
        cache.close()
    assert not (be.layers.root / ("6" * 64)).exists()
    assert be.layers.meta(digest) is not None

    be.remove("sha256:gc-chain")
    be.cleanup()
    cache = ChunkCache(be.sn.root / "cache", 1 << 20)
    try:
        assert not cache.contains(kept_key), "the image is gone: its chunks go too"
    finally:
        cache.close()
    assert be.layers.meta(digest) is None


def test_a_spare_that_gives_no_answer_leaves_the_parse_to_the_daemon(
        backend: tuple[RemoteBackend, FakeMounter], registry: RegistryProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait that ends without an answer (the spare declined, died, or is stuck) costs at most
    half the resolve's time, and the daemon parses as before, storing the index it made."""
    be, mounter = backend
    waits: list[float] = []

    def declining(parse: MetadataParse, data: bytes, key: str, image_layers: tuple[str, ...] = (), *,
                  want_answer: bool = False, early: Mapping[str, Any] | None = None) -> SpareWait | None:
        assert want_answer
        mounter.preloads.append((parse, data, image_layers))
        return lambda timeout: waits.append(timeout)  # type: ignore[func-returns-value]

    monkeypatch.setattr(mounter, "preload", declining)
    blob, toc_digest = _estargz({"d.txt": b"daemon parsed\n"})
    image = push_image(registry.url, "lazy/sparedeclined", "v1", [blob])
    (layer,) = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, layer, "sha256:sd1"))
    p, data, _layers = mounter.preloads[0]
    assert be.layers.load(layer) == parse_metadata(p, data)
    assert (be.layers.layer_dir(layer) / INDEX_FILE).exists()
    assert not (be.layers.layer_dir(layer) / METADATA_FILE).exists()
    meta = be.layers.meta(layer)
    assert meta is not None and meta.toc_digest == toc_digest
    (timeout,) = waits
    assert 0 < timeout <= min(resolver_module.SPARE_PARSE_WAIT, be.config.resolve_timeout / 2)


def test_garbage_collection_keeps_live_chunks_without_loading_an_index(
        backend: tuple[RemoteBackend, FakeMounter], registry: RegistryProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collection lists a live layer's cache keys from its keys file (remote/store.py), so
    the daemon does not load the index (its memory peak) on every Cleanup."""
    be, _mounter = backend
    live, dead = b"live chunk\n" * 10, b"nobody's chunk\n"
    blob, _toc = _estargz({"live.txt": live})
    image = push_image(registry.url, "lazy/gckeys", "v1", [blob])
    (layer,) = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, layer, "sha256:gc1"))
    live_key, dead_key = (f"sha256:{hashlib.sha256(d).hexdigest()}" for d in (live, dead))
    assert live_key in layer_cache_keys(be.layers.load(layer), layer)
    cache = ChunkCache(be.sn.root / "cache", be.config.cache.max_bytes)
    assert cache.put(live_key, live) and cache.put(dead_key, dead)
    cache.close()

    def no_index(digest: str) -> None:
        raise AssertionError(f"the collection loaded the index of {digest}")

    monkeypatch.setattr(be.layers, "load", no_index)
    be.collect_garbage()
    cache = ChunkCache(be.sn.root / "cache", be.config.cache.max_bytes)
    try:
        assert cache.get(live_key) == live and cache.get(dead_key) is None
    finally:
        cache.close()


@pytest.mark.parametrize("spare_parses", [False, True])
def test_a_zstd_chunked_toc_digest_label_is_checked_whoever_parses(
        backend: tuple[RemoteBackend, FakeMounter], registry: RegistryProcess, caplog: pytest.LogCaptureFixture,
        spare_parses: bool) -> None:
    be, mounter = backend
    mounter.spare_parses = spare_parses
    caplog.set_level(logging.INFO)
    out = io.BytesIO()
    result = write_zstdchunked(io.BytesIO(tar_of({"z.txt": b"zstd chunked\n" * 50})), out)
    image = push_image(registry.url, f"lazy/zstdcheck{int(spare_parses)}", "v1", [out.getvalue()])
    (layer,) = image.layers
    be.prepare("default/1/extract-1", "", _labels(image.ref, layer, "sha256:zc1", **{
        "containerd.io/snapshot/stargz/toc.digest": "sha256:" + "0" * 64}))
    (line,) = _fallback_lines(caplog)
    assert layer in line and "reason=toc_digest_mismatch" in line, line
    assert be.layers.meta(layer) is None
    # The right label: stored, from whichever parse.
    with pytest.raises(AlreadyExists):
        be.prepare("default/2/extract-1", "", _labels(image.ref, layer, "sha256:zc2", **{
            "containerd.io/snapshot/stargz/toc.digest": result.toc_digest}))
    meta = be.layers.meta(layer)
    assert meta is not None and meta.format == "zstdchunked" and meta.toc_digest == result.toc_digest


def test_preloads_carry_what_the_spare_needs_to_prefetch_early_only_with_mount_on_pull(
        backend: tuple[RemoteBackend, FakeMounter], registry: RegistryProcess, tmp_path: Path) -> None:
    """With mount_on_pull (the default) each preload carries the layer's reader spec, the config,
    the hosts found to answer plain HTTP and the auth hand-off (fusefs/early.py); without it none
    does: an image pulled but never run then costs no prefetch."""
    be, mounter = backend
    blob, _toc = _estargz({"etc/passwd": b"root:x:0:0::/root:/bin/sh\n"})
    image = push_image(registry.url, "lazy/early", "v1", [blob])
    (layer,) = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("default/1/extract-1", "", _labels(image.ref, layer, "sha256:early1"))
    (early,) = mounter.early
    assert early is not None
    assert early["reader"] == {"kind": "registry", "image_ref": image.ref, "layer_digest": layer,
                               "blob_size": len(blob)}
    assert early["config"]["root"] == be.config.root and early["config"]["mount_on_pull"] is True
    assert early["plain_http_hosts"] == [registry.host]  # the loopback registry answers plain HTTP
    assert isinstance(early["auth"], dict)

    off = Config(root=str(tmp_path / "off"), resolve_timeout=5.0, mount_on_pull=False)
    quiet = FakeMounter(tmp_path)
    be_off = RemoteBackend(Snapshotter(tmp_path / "off"), off, quiet)
    try:
        with pytest.raises(AlreadyExists):
            be_off.prepare("default/1/extract-1", "", _labels(image.ref, layer, "sha256:early2"))
    finally:
        be_off.close()
    assert quiet.early == [None] and len(quiet.preloads) == 1


def test_a_container_created_over_remote_layers_has_its_program_fetched_by_the_images_mount(
        registry: RegistryProcess, backend: tuple[RemoteBackend, FakeMounter]) -> None:
    """containerd names the container's snapshot NAMESPACE/N/KEY to us: the created container's
    key finds it, and the mount of the image under it is asked for the program; a container over
    local layers only, another namespace's key or an unknown one asks nothing."""
    be, mounter = backend
    blob, _toc = _estargz({"usr/bin/tool": b"\x7fELF tool"})
    image = push_image(registry.url, "lazy/program", "v1", [blob])
    (layer,) = image.layers
    with pytest.raises(AlreadyExists):
        be.prepare("ns1/3/extract-1", "", _labels(image.ref, layer, "sha256:pg1"))
    be.prepare("ns1/9/ctr-1", "sha256:pg1", {})
    be.prepare("ns1/10/local-base", "", {})
    be.commit("ns1/11/sha256:local", "ns1/10/local-base", {})
    be.prepare("ns1/12/ctr-2", "ns1/11/sha256:local", {})
    tool = Program("tool", ("/usr/bin",), "/")
    assert be.container_created("ns1", "lazy", "ctr-1", tool)
    assert mounter.programs == [(be.sn.snapshot("sha256:pg1").id, tool.to_doc())]
    assert not be.container_created("ns1", "lazy", "ctr-2", tool)  # nothing remote under it
    assert not be.container_created("ns2", "lazy", "ctr-1", tool)
    assert not be.container_created("ns1", "lazy", "ctr-9", tool)
    assert len(mounter.programs) == 1
