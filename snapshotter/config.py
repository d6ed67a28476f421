"""The daemon's configuration: a TOML file, defaults, and command-line overrides.

Every key is declared once in `SCHEMA` (section, key, type, default, doc). `load_config` reads a
file, rejects unknown keys and wrong types with a ConfigError that names the file, the line and
the key, and returns a frozen `Config`. `config/config.toml` documents the same keys and a test
checks the two agree.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from snapshotter.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/snapshotter/config.toml")
DEFAULT_ROOT = Path("/var/lib/snapshotter")
DEFAULT_ADDRESS = Path("/run/snapshotter/snapshotter.sock")


@dataclass(frozen=True)
class RegistryConfig:
    config_path: str = field(default="", metadata={"doc": "directory of containerd-style HOST/hosts.toml files"})
    docker_config: str = field(default="", metadata={
        "doc": "docker config.json with credentials ('' = ~/.docker/config.json)"})
    request_timeout: float = field(default=30.0, metadata={"doc": "seconds for one registry request"})
    retries: int = field(default=3, metadata={"doc": "retries of a failed registry request (5xx, reset)"})
    max_parallel: int = field(default=8, metadata={"doc": "concurrent requests per registry host"})
    max_merge_bytes: int = field(default=8 << 20, metadata={"doc": "merge adjacent chunk ranges up to this many bytes"})
    amplify_bytes: int = field(default=512 << 10, metadata={
        "doc": "a read that misses the cache also fetches up to this many bytes of the chunks stored right after "
               "it, in the same request (0 = off)"})


@dataclass(frozen=True)
class CacheConfig:
    max_bytes: int = field(default=50 << 30, metadata={"doc": "hard cap of the on-disk chunk cache in bytes"})
    max_inflight_bytes: int = field(default=32 << 20, metadata={
        "doc": "cap on chunk bytes being fetched at once, per mount: range bytes requested, and the memory "
               "the fetches hold (a streamed fetch about 1.25 MiB, a chunk kept in memory all of it)"})
    direct_read_min_bytes: int = field(default=16 << 20, metadata={
        "doc": "with metadata images: a file of at least this many bytes (and more than one chunk), once read to "
               "its end and wholly cached, is also stored whole in the cache and handed to overlayfs, so containers "
               "started after that read it from disk directly, not through the FUSE mount; it costs its size again "
               "in the cache while its chunks stay (0 = off)"})


@dataclass(frozen=True)
class LimitsConfig:
    max_toc_bytes: int = field(default=256 << 20, metadata={"doc": "largest eStargz/zstd:chunked TOC accepted"})
    max_bootstrap_bytes: int = field(default=1 << 30, metadata={"doc": "largest Nydus bootstrap accepted"})


@dataclass(frozen=True)
class PrefetchConfig:
    background: bool = field(default=True, metadata={
        "doc": "after the landmark prefetch, fetch the rest of each mounted layer into the cache"})
    background_bytes_per_second: int = field(default=0, metadata={
        "doc": "bandwidth cap of the background fetch per mount (0 = unlimited)"})
    background_delay: float = field(default=3.0, metadata={
        "doc": "seconds without filesystem requests (any kind) before the background fetch starts or resumes"})
    startup_files: bool = field(default=True, metadata={
        "doc": "when an image's mount starts, also prefetch the files nearly every container start reads: "
               "/etc/passwd and /etc/group (runc), the dynamic loader, /etc/ld.so.cache and libc.so.6; the "
               "container's start does not wait for them even with prefetch.wait (its reads wait for the fetch in "
               "flight); with `mount_on_pull` the spare starts them, and each layer's prefetch list, as soon as it "
               "has parsed the layer during the pull"})
    wait: bool = field(default=False, metadata={
        "doc": "container start waits for each layer's prefetch list (landmark, Nydus prefetch table) to be "
               "fetched, at most prefetch_timeout, as stargz-snapshotter does; off: only until its fetch is in "
               "flight (a read of a file being prefetched waits for that fetch, never fetching it twice), which "
               "started containers over a recorded profile 0.1-0.2 s sooner and no recorded workload later"})
    program: bool = field(default=True, metadata={
        "doc": "when containerd creates a container over a lazily mounted image, prefetch the program it will run "
               "(its args[0], looked up in its PATH as runc does; at most 16 MiB of it), learned from containerd's "
               "container events, so runc's exec of it finds it cached (needs containerd_address)"})


@dataclass(frozen=True)
class Config:
    root: str = field(default=str(DEFAULT_ROOT), metadata={"doc": "state directory (metadata, snapshots, cache)"})
    address: str = field(default=str(DEFAULT_ADDRESS), metadata={"doc": "unix socket containerd connects to"})
    log_level: str = field(default="info", metadata={"doc": "debug, info, warning or error"})
    log_format: str = field(default="text", metadata={"doc": "text (key=value) or json"})
    metrics_address: str = field(default="", metadata={"doc": "host:port for Prometheus /metrics ('' = off)"})
    containerd_address: str = field(default="/run/containerd/containerd.sock", metadata={
        "doc": "containerd's own socket, whose container events tell what each new container runs "
               "(prefetch.program; '' = not watched)"})
    resolve_timeout: float = field(default=30.0, metadata={
        "doc": "seconds to resolve a lazy layer before falling back"})
    fetch_timeout: float = field(default=60.0, metadata={"doc": "seconds a read waits for a chunk before EIO"})
    prefetch_timeout: float = field(default=10.0, metadata={
        "doc": "seconds container start waits at most for prefetch (to be in flight; with prefetch.wait, to end)"})
    resolve_ahead: bool = field(default=True, metadata={
        "doc": "when a layer is pulled lazily, resolve the image's layers above it at the same time (containerd "
               "prepares them one after another)"})
    mount_on_pull: bool = field(default=True, metadata={
        "doc": "start an image's mount when its last layer is pulled lazily, before its first container asks "
               "(stopped again when no container uses it within 60 s)"})
    spare_mount_process: bool = field(default=True, metadata={
        "doc": "keep one mount process started ahead, so an image's mount skips Python start-up (about 37 MiB "
               "while it waits)"})
    preload_metadata: bool = field(default=True, metadata={
        "doc": "hand the spare mount process each lazy layer's metadata (TOC, bootstrap) as the daemon resolves "
               "it, so the spare parses it (on another core, and in place of the daemon, which stores the metadata "
               "bytes once the spare says they parse) and the image's mount starts from it instead of loading the "
               "daemon's copy afterwards (needs spare_mount_process)"})
    metadata_image: bool = field(default=True, metadata={
        "doc": "write an EROFS image of each image's file tree once its mount is idle (once; kept) and mount it "
               "next to the image's mount, so containers started after that get lookups, stats and directory "
               "listings from the kernel and reach the FUSE mount only to read file bytes (needs Linux 6.5+; "
               "checked, else off)"})
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)

    def replace(self, **changes: Any) -> Config:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Config(**values)


_SECTIONS: dict[str, type] = {"registry": RegistryConfig, "cache": CacheConfig, "limits": LimitsConfig,
                              "prefetch": PrefetchConfig}
_LOG_LEVELS = ("debug", "info", "warning", "error")


def _line_of(text: str, section: str | None, key: str) -> int | None:
    """Best-effort line number of `key` (inside `[section]` when given) in TOML `text`."""
    current: str | None = None
    key_re = re.compile(rf'^\s*("{re.escape(key)}"|{re.escape(key)})\s*=')
    for lineno, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"^\s*\[\s*([^\]]+?)\s*\]", line)
        if header:
            current = header.group(1).strip('"')
            if section is None and current == key:
                return lineno
            continue
        if current == section and key_re.match(line):
            return lineno
    return None


def _check_value(path: str, key: str, section: str | None, text: str, value: Any, expected: type) -> Any:
    def fail(msg: str) -> ConfigError:
        line = _line_of(text, section, key)
        where = f"{path} line {line}" if line else path
        dotted = f"{section}.{key}" if section else key
        return ConfigError(f"{where}: key '{dotted}': {msg}")

    if expected is bool:
        if not isinstance(value, bool):
            raise fail(f"expected true or false, got {type(value).__name__} {value!r}")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(f"expected a number, got {type(value).__name__} {value!r}")
        if value < 0:
            raise fail(f"must not be negative, got {value!r}")
        return float(value)
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(f"expected an integer, got {type(value).__name__} {value!r}")
        if value < 0:
            raise fail(f"must not be negative, got {value!r}")
        return value
    if expected is str:
        if not isinstance(value, str):
            raise fail(f"expected a string, got {type(value).__name__} {value!r}")
        if key == "log_level" and value not in _LOG_LEVELS:
            raise fail(f"must be one of {', '.join(_LOG_LEVELS)}, got {value!r}")
        if key == "log_format" and value not in ("text", "json"):
            raise fail(f"must be 'text' or 'json', got {value!r}")
        return value
    raise AssertionError(expected)


def _build(cls: type, data: dict[str, Any], *, path: str, text: str, section: str | None) -> Any:
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            line = _line_of(text, section, key)
            where = f"{path} line {line}" if line else path
            dotted = f"{section}.{key}" if section else key
            valid = ", ".join(sorted(known))
            raise ConfigError(f"{where}: unknown key '{dotted}' (valid keys here: {valid})")
        ftype = known[key].type
        if section is None and key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: key '{key}' must be a table [{key}]")
            values[key] = _build(_SECTIONS[key], value, path=path, text=text, section=key)
            continue
        type_name = ftype if isinstance(ftype, str) else ftype.__name__
        expected = {"str": str, "int": int, "float": float, "bool": bool}[type_name]
        values[key] = _check_value(path, key, section, text, value, expected)
    return cls(**values)


def parse_config(text: str, *, path: str = "<config>") -> Config:
    """Parse TOML text into a Config; ConfigError names `path`, the line and the key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    config: Config = _build(Config, data, path=path, text=text, section=None)
    return config


def config_from_mapping(data: dict[str, Any], *, path: str = "<mapping>") -> Config:
    """A Config from already-parsed data (e.g. dataclasses.asdict of one), validated like a file."""
    config: Config = _build(Config, data, path=path, text="", section=None)
    return config


def load_config(path: Path | None, *, required: bool = False) -> Config:
    """Read `path` (default /etc/snapshotter/config.toml). A missing default file gives defaults;
    a missing file named explicitly (`required`) is an error."""
    target = path or DEFAULT_CONFIG_PATH
    try:
        text = target.read_text()
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{target}: config file does not exist") from None
        return Config()
    except OSError as exc:
        raise ConfigError(f"{target}: cannot read config file: {exc.strerror}") from None
    return parse_config(text, path=str(target))


def schema_keys() -> dict[str, str]:
    """Every config key as 'key' or 'section.key' -> its doc string (for docs and tests)."""
    out: dict[str, str] = {}
    for f in fields(Config):
        if f.name in _SECTIONS:
            for sf in fields(_SECTIONS[f.name]):
                out[f"{f.name}.{sf.name}"] = sf.metadata["doc"]
        else:
            out[f.name] = f.metadata["doc"]
    return out
