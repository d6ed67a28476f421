"""Resolved layers persisted under the root, so mount processes and a restarted daemon need no
registry round trip to know a layer's tree.

    ROOT/layers/<sha256 hex of the layer digest>/index.bin    the LayerIndex (index_codec; a root
                                                              written by 0.1 holds index.json)
    ROOT/layers/<...>/metadata.bin, parse.json                or, instead, the layer's metadata bytes
                                                              (the TOC member, the bootstrap layer) and
                                                              how they parse (`MetadataParse.to_doc`)
    ROOT/layers/<...>/cache-keys                              the cache keys of its chunks (one per line)
    ROOT/layers/<...>/meta.json                               format, blob size, where it came from
    ROOT/layers/<...>/fallback.json                           why the last lazy attempt fell back

Every file is written to a temp name and renamed, meta.json last: a layer directory without
meta.json is incomplete and is ignored (and rewritten by the next resolve). cache-keys is what
the daemon's garbage collection keeps of a live layer (`layer_cache_keys`); without it (a root
written before it existed, a mount that has not written it yet) a child process derives the keys
from the index or the metadata bytes (`LayerStore.cache_keys`), so that the index's memory peak
(some 10 MiB for 11,000 entries) never lands in the daemon.

A layer the spare mount process parsed is stored as its metadata bytes (`save_metadata`): what
containerd's Prepare waits for is then a write of those bytes, not the index's encoding (some
35 ms for 11,000 entries). The index is derived from them where it is needed
(`load_layer_index`: parse the bytes, deterministically, as the spare did), and the mount process
holding the parsed index writes index.bin and cache-keys beside them once it is quiet
(`write_derived_index`), so later loads and collections read those.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from snapshotter.errors import FormatError
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.index_codec import dump_index, load_index
from snapshotter.formats.metadata_parse import MetadataParse, parse_metadata
from snapshotter.reader.keys import cache_keys

INDEX_FILE = "index.bin"
LEGACY_INDEX_FILE = "index.json"
KEYS_FILE = "cache-keys"
# Bound on the child that derives a layer's keys without a keys file (0.2-0.5 s for 11,000 entries).
DERIVE_KEYS_TIMEOUT = 120.0
METADATA_FILE = "metadata.bin"
PARSE_FILE = "parse.json"


def blob_digests(index: LayerIndex, layer_digest: str) -> list[str]:
    """Registry digests of the index's blobs: eStargz/zstd:chunked name the layer itself; Nydus
    names blob ids (the hex sha256 of each blob layer)."""
    if not index.blobs:
        return [layer_digest]
    return [b if ":" in b else f"sha256:{b}" for b in index.blobs]


def layer_cache_keys(index: LayerIndex, layer_digest: str) -> set[str]:
    """Every key a reader of the layer may cache its bytes under (reader/keys.py `cache_keys`).
    FormatError for a chunk digest the cache cannot address."""
    blobs = blob_digests(index, layer_digest)
    keys: set[str] = set()
    for e in index.regular_files():
        keys.update(cache_keys(e, blobs))
    return keys


def dump_keys(keys: set[str]) -> bytes:
    return "".join(f"{k}\n" for k in sorted(keys)).encode("ascii")


def load_keys(data: bytes) -> set[str]:
    """The keys `dump_keys` wrote; FormatError for anything else."""
    try:
        return set(data.decode("ascii").splitlines())
    except UnicodeDecodeError as exc:
        raise FormatError(f"cache keys file: not ASCII ({exc})") from None


def load_layer_index(index_file: Path) -> LayerIndex:
    """The index stored at `index_file` (index_codec), else derived from the metadata bytes
    stored beside it (`LayerStore.save_metadata`: parsed as parse.json says). FileNotFoundError
    (naming `index_file`) when neither is there; FormatError for what does not load or parse."""
    try:
        return load_index(index_file.read_bytes())
    except FileNotFoundError:
        metadata, parse_doc = index_file.with_name(METADATA_FILE), index_file.with_name(PARSE_FILE)
        try:
            parse, data = MetadataParse.from_doc(json.loads(parse_doc.read_bytes())), metadata.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no layer index, nor metadata to derive it from",
                                    str(index_file)) from None
        except ValueError as exc:  # not JSON
            raise FormatError(f"{parse_doc}: not a parse description: {exc}") from None
        return parse_metadata(parse, data)


def write_derived_index(index_file: Path, index: LayerIndex, layer_digest: str, parse_key: str) -> bool:
    """Write `index` (parsed under `parse_key`) at `index_file` with its cache keys, when that
    layer directory holds the layer's metadata bytes but no index yet, and still the metadata
    that parse came from (meta.json's parse_key): a later resolve of the layer may have replaced
    it meanwhile. The keys go first (unless `write_derived_keys` wrote them), so an index file
    never lacks them. True when written."""
    d = index_file.parent
    if index_file.exists() or not _derived_from(d, parse_key):
        return False
    if not (d / KEYS_FILE).exists():  # save_metadata removes a stale one: one there is this parse's
        _write_keys(d, index, layer_digest)
    _write_atomic(index_file, dump_index(index))
    return True


def write_derived_keys(index_file: Path, index: LayerIndex, layer_digest: str, parse_key: str) -> bool:
    """The cache-keys file alone of `write_derived_index`, on the same conditions, unless it is
    there. A mount process writes it itself before it exits (14 ms for the bench image's 8,000
    keys), so the collection on the Cleanup that follows a container's removal finds it instead
    of deriving the index in the daemon (about 10 MiB of its memory for an 11,000-entry TOC);
    the index, slower to encode, is left to the mount's forked writer. True when written."""
    d = index_file.parent
    if index_file.exists() or (d / KEYS_FILE).exists() or not _derived_from(d, parse_key):
        return False
    return _write_keys(d, index, layer_digest)


def _derived_from(d: Path, parse_key: str) -> bool:
    """Whether layer directory `d` holds metadata bytes stored under `parse_key` (meta.json)."""
    try:
        meta = json.loads((d / "meta.json").read_bytes())
    except (OSError, ValueError):
        return False
    return (d / METADATA_FILE).exists() and isinstance(meta, dict) and meta.get("parse_key") == parse_key


def _write_keys(d: Path, index: LayerIndex, layer_digest: str) -> bool:
    """The cache-keys file of `index` in layer directory `d`; False (none written) when the keys
    cannot be listed."""
    try:
        _write_atomic(d / KEYS_FILE, dump_keys(layer_cache_keys(index, layer_digest)))
    except FormatError:
        return False  # the collection finds no keys and loads the index, which says what is wrong
    return True


@dataclass(frozen=True)
class LayerMeta:
    layer_digest: str
    format: str
    blob_size: int
    image_ref: str
    toc_digest: str | None
    # MetadataParse.key of the parse that made the index (formats/metadata_parse.py): a mount
    # process handed an index parsed ahead under this key uses it instead of loading the file.
    # None for indexes written before it existed, or that needed no parse.
    parse_key: str | None = None


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class LayerStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def layer_dir(self, layer_digest: str) -> Path:
        algo, _, hexpart = layer_digest.partition(":")
        if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
            raise ValueError(f"not a sha256 layer digest: {layer_digest!r}")
        return self.root / hexpart

    def index_path(self, layer_digest: str) -> Path:
        """Where the layer's index is: index.bin, or the JSON index.json an earlier release wrote
        (`load_index` reads both)."""
        d = self.layer_dir(layer_digest)
        legacy = d / LEGACY_INDEX_FILE
        return legacy if not (d / INDEX_FILE).exists() and legacy.exists() else d / INDEX_FILE

    def save(self, meta: LayerMeta, index: LayerIndex) -> Path:
        d = self.layer_dir(meta.layer_digest)
        d.mkdir(parents=True, exist_ok=True)
        for stale in (KEYS_FILE, METADATA_FILE, PARSE_FILE):  # an earlier resolve's never outlive it
            (d / stale).unlink(missing_ok=True)
        _write_atomic(d / INDEX_FILE, dump_index(index))
        _write_keys(d, index, meta.layer_digest)
        return self._finish(d, meta)

    def save_metadata(self, meta: LayerMeta, parse: MetadataParse, data: bytes) -> Path:
        """As `save`, storing the layer's metadata bytes and how they parse instead of the index
        (`load_layer_index` derives it; the module docstring says who writes it later). The
        caller knows that they parse: the spare mount process did, as `parse` says."""
        d = self.layer_dir(meta.layer_digest)
        d.mkdir(parents=True, exist_ok=True)
        for stale in (INDEX_FILE, KEYS_FILE, LEGACY_INDEX_FILE):
            (d / stale).unlink(missing_ok=True)
        _write_atomic(d / METADATA_FILE, data)
        _write_atomic(d / PARSE_FILE, json.dumps(parse.to_doc(), sort_keys=True).encode())
        return self._finish(d, meta)

    def _finish(self, d: Path, meta: LayerMeta) -> Path:
        (d / LEGACY_INDEX_FILE).unlink(missing_ok=True)
        _write_atomic(d / "meta.json", json.dumps(asdict(meta), sort_keys=True).encode())
        return d / INDEX_FILE

    def cache_keys(self, layer_digest: str) -> set[str]:
        """The layer's cache keys, from its keys file, else derived from its index or metadata
        bytes by a child process (remote/derive_keys.py: this process's peak memory never holds
        the index). OSError (FileNotFoundError when there is nothing to derive them from) or
        FormatError, naming the layer."""
        try:
            return load_keys((self.layer_dir(layer_digest) / KEYS_FILE).read_bytes())
        except FileNotFoundError:
            pass
        argv = [sys.executable, "-m", "snapshotter.remote.derive_keys", str(self.index_path(layer_digest)),
                layer_digest]
        try:
            child = subprocess.run(argv, capture_output=True, timeout=DERIVE_KEYS_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise OSError(errno.ETIMEDOUT, f"layer {layer_digest}: deriving its cache keys took over "
                                           f"{DERIVE_KEYS_TIMEOUT:.0f}s") from None
        why = child.stderr.decode(errors="replace").strip()[-500:]
        if child.returncode == 2:
            raise FileNotFoundError(errno.ENOENT, f"layer {layer_digest}: no cache keys, index or metadata "
                                                  f"to derive them from ({why})")
        if child.returncode != 0:
            raise FormatError(f"layer {layer_digest}: cannot derive its cache keys: {why or child.returncode}")
        return load_keys(child.stdout)

    def meta(self, layer_digest: str) -> LayerMeta | None:
        try:
            raw = json.loads((self.layer_dir(layer_digest) / "meta.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return LayerMeta(**raw)

    def load(self, layer_digest: str) -> LayerIndex:
        """The layer's index (`load_layer_index`)."""
        return load_layer_index(self.index_path(layer_digest))

    # -- fallbacks (for `snapshotter status`) --------------------------------------------------

    def record_fallback(self, layer_digest: str, doc: dict[str, object]) -> None:
        """Remember why `layer_digest` fell back (reason, image, time, ...); ValueError for a bad digest."""
        d = self.layer_dir(layer_digest)
        d.mkdir(parents=True, exist_ok=True)
        _write_atomic(d / "fallback.json", json.dumps(doc, sort_keys=True).encode())

    def fallback(self, layer_digest: str) -> dict[str, object] | None:
        """The recorded fallback of `layer_digest`, or None."""
        try:
            doc = json.loads((self.layer_dir(layer_digest) / "fallback.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def clear_fallback(self, layer_digest: str) -> None:
        try:
            (self.layer_dir(layer_digest) / "fallback.json").unlink(missing_ok=True)
        except ValueError:
            pass

    def remove_unreferenced(self, layer_digests: set[str]) -> list[str]:
        """Delete the persisted indexes of layers not in `layer_digests`; return their digests.
        A fallback record stays (status reports it for the locally unpacked layer)."""
        keep = {self.layer_dir(d).name for d in layer_digests}
        removed = []
        for d in sorted(self.root.iterdir()):
            if not d.is_dir() or d.name in keep or len(d.name) != 64:
                continue
            if (d / "fallback.json").exists():
                # meta.json first: without it the rest is ignored
                for name in ("meta.json", INDEX_FILE, LEGACY_INDEX_FILE, KEYS_FILE, METADATA_FILE, PARSE_FILE):
                    (d / name).unlink(missing_ok=True)
            else:
                shutil.rmtree(d, ignore_errors=True)
            removed.append(f"sha256:{d.name}")
        return removed
