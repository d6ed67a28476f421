"""Settings of the registry client. The daemon maps its TOML onto `FetchConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FetchConfig:
    """Knobs of `RegistryClient`; defaults suit a node pulling from a nearby registry.

    Timeouts are seconds. `retries` counts retries after the first attempt (0 = one try).
    max_merge_bytes: adjacent or overlapping ranges are merged into one request span while the
      span stays at most this big; also the byte budget of one multi-range request.
    max_merge_gap: ranges this far apart still merge (the gap bytes are fetched and dropped).
    max_ranges_per_request: spans per `Range: bytes=a-b,c-d,...` request.
    max_inflight_bytes: range bytes requested and not yet returned, across all registries;
      a single request bigger than this still runs, alone.
    docker_config: a docker `config.json` for credentials; None = anonymous only.
    hosts_config_path: containerd's `config_path` directory (HOST/hosts.toml); None = defaults.
    mirror_cooldown: seconds a mirror that failed at the connection level is skipped.
    """

    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    request_timeout: float = 120.0
    retries: int = 3
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    max_merge_bytes: int = 4 << 20
    max_merge_gap: int = 0
    max_ranges_per_request: int = 16
    max_parallel_per_registry: int = 8
    max_inflight_bytes: int = 128 << 20
    max_manifest_bytes: int = 4 << 20
    docker_config: Path | None = None
    hosts_config_path: Path | None = None
    mirror_cooldown: float = 30.0
    token_expiry_margin: float = 10.0
    user_agent: str = "snapshotter/0.1"

    def __post_init__(self) -> None:
        from snapshotter.errors import ConfigError

        for name in ("connect_timeout", "read_timeout", "request_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"fetch config: {name} must be > 0, got {getattr(self, name)}")
        for name in ("max_merge_bytes", "max_ranges_per_request", "max_parallel_per_registry",
                     "max_inflight_bytes", "max_manifest_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"fetch config: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("retries", "max_merge_gap", "backoff_initial", "backoff_max", "mirror_cooldown",
                     "token_expiry_margin"):
            if getattr(self, name) < 0:
                raise ConfigError(f"fetch config: {name} must be >= 0, got {getattr(self, name)}")
