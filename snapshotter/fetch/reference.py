"""Image references: `[REGISTRY/]REPOSITORY[:TAG][@DIGEST]`, normalized as docker does.

- No registry part (the first path component has no ".", no ":" and is not "localhost")
  means docker.io; a single-component docker.io repository gets "library/".
- "index.docker.io" is docker.io.
- Neither tag nor digest means tag "latest".
- Registries may be `host`, `host:port`, or `[v6addr]:port`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from snapshotter.errors import SnapshotterError

DOCKER_IO = "docker.io"

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}$")
_HOST_RE = re.compile(
    r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)"
    r"(?::[0-9]+)?$"
)


class InvalidReference(SnapshotterError, ValueError):
    """A string is not a valid image reference."""


@dataclass(frozen=True)
class Reference:
    """A parsed, normalized reference. `tag` and `digest` may both be set (digest wins)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def object(self) -> str:
        """What to ask `/v2/REPO/manifests/` for: the digest if any, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        out = self.name
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def parse_reference(text: str) -> Reference:
    """Parse and normalize `text`; raise InvalidReference naming it when it is malformed."""
    rest = text.strip()
    if not rest or rest != text:
        raise InvalidReference(f"invalid image reference {text!r}: empty or surrounded by spaces")
    digest: str | None = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise InvalidReference(f"invalid image reference {text!r}: bad digest {digest!r}")
    registry = DOCKER_IO
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry = first
        rest = remainder
    tag: str | None = None
    # A ":" after the last "/" is the tag separator (a registry port was already split off).
    colon = rest.rfind(":")
    if colon > rest.rfind("/"):
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG_RE.match(tag):
            raise InvalidReference(f"invalid image reference {text!r}: bad tag {tag!r}")
    if not _HOST_RE.match(registry):
        raise InvalidReference(f"invalid image reference {text!r}: bad registry {registry!r}")
    if registry == "index.docker.io":
        registry = DOCKER_IO
    if registry == DOCKER_IO and "/" not in rest:
        rest = f"library/{rest}"
    if not _REPO_RE.match(rest) or len(rest) > 255:
        raise InvalidReference(f"invalid image reference {text!r}: bad repository {rest!r}")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, rest, tag, digest)

