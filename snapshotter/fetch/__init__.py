"""The registry side of the remote data path: references, hosts.toml, auth, Range fetching.

The one package that knows HTTP; everything it raises is a `snapshotter.errors.FetchError`
(or ConfigError for a broken hosts.toml / FetchConfig, InvalidReference for a bad reference).
"""

from snapshotter.fetch.client import Descriptor, FetchStatistics, Manifest, RegistryClient, RegistryError
from snapshotter.fetch.config import FetchConfig
from snapshotter.fetch.hosts import RegistryHost, load_hosts
from snapshotter.fetch.reference import InvalidReference, Reference, parse_reference

__all__ = [
    "Descriptor",
    "FetchConfig",
    "FetchStatistics",
    "InvalidReference",
    "Manifest",
    "Reference",
    "RegistryClient",
    "RegistryError",
    "RegistryHost",
    "load_hosts",
    "parse_reference",
]
