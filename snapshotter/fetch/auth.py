"""Registry authentication: WWW-Authenticate challenges, docker credentials, bearer tokens.

Flow (as containerd's docker authorizer): a request goes out without Authorization until the
host answers 401; its challenge is remembered per host. Then every request to that host gets
- Basic: the host's credentials;
- Bearer: a token from the challenge's realm for (service, scope), fetched anonymously, with
  Basic credentials (GET), or with an identity token (POST, grant_type=refresh_token), cached
  until `expires_in` (default 60 s) minus a margin.
A 401 on a request that carried a token drops that token; the caller retries once.

Hand-off (`Authorizer.handoff` / `adopt`): what one process learned (each host's challenge, the
tokens of given scopes that are good for a while yet) taken over by another, so that a mount
process's first request to the registry carries the daemon's token instead of meeting a 401 and
fetching a token of its own (two round trips, and a connection to the token server, on the
container's start path). The hand-off holds tokens: it travels over a pipe, never through a file.

Credentials come from a docker `config.json`: `credHelpers[host]` or `credsStore` run as
`docker-credential-NAME get` (host on stdin, JSON {Username, Secret} out; Username "<token>"
means an identity token), else `auths[host]` with `auth` (base64 user:pass), `username` /
`password`, or `identitytoken`. Docker Hub's key is "https://index.docker.io/v1/".
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import trio

from snapshotter.errors import FetchError

log = logging.getLogger("snapshotter.fetch.auth")

DOCKER_HUB_KEY = "https://index.docker.io/v1/"
_DOCKER_HUB_HOSTS = ("docker.io", "index.docker.io", "registry-1.docker.io")
DEFAULT_TOKEN_LIFETIME = 60.0
HELPER_TIMEOUT = 30.0
MAX_TOKEN_RESPONSE = 1 << 20
# A token with less life left than this is not handed off: the other process would fetch its own
# soon anyway, and clocks need some slack.
HANDOFF_MIN_SECONDS = 10.0


class AuthError(FetchError):
    """Authentication failed: no usable challenge, no credentials, or the token server refused.

    `retryable` is True for token-server 5xx and connection errors.
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Challenge:
    """One auth challenge; `scheme` lowercased ("bearer", "basic"), parameter names lowercased."""

    scheme: str
    params: Mapping[str, str]


def parse_www_authenticate(values: Iterable[str]) -> list[Challenge]:
    """Parse WWW-Authenticate header values (RFC 9110 §11.6.1); unparseable tails are dropped."""
    out: list[Challenge] = []
    for value in values:
        out.extend(_parse_one(value))
    return out


def _parse_one(s: str) -> list[Challenge]:
    out: list[Challenge] = []
    i, n = 0, len(s)
    scheme: str | None = None
    params: dict[str, str] = {}

    def skip(chars: str) -> None:
        nonlocal i
        while i < n and s[i] in chars:
            i += 1

    def token() -> str:
        nonlocal i
        start = i
        while i < n and s[i] not in ' \t,="':
            i += 1
        return s[start:i]

    while i < n:
        skip(" \t,")
        if i >= n:
            break
        word = token()
        if not word:
            break
        skip(" \t")
        if i < n and s[i] == "=" and scheme is not None:
            i += 1
            skip(" \t")
            if i < n and s[i] == '"':
                i += 1
                buf = []
                while i < n and s[i] != '"':
                    if s[i] == "\\" and i + 1 < n:
                        i += 1
                    buf.append(s[i])
                    i += 1
                i += 1
                params[word.lower()] = "".join(buf)
            else:
                params[word.lower()] = token()
        else:
            if scheme is not None:
                out.append(Challenge(scheme, MappingProxyType(params)))
            scheme, params = word.lower(), {}
    if scheme is not None:
        out.append(Challenge(scheme, MappingProxyType(params)))
    return out


@dataclass(frozen=True)
class Credentials:
    """username + secret; username "" means `secret` is an identity (refresh) token."""

    username: str
    secret: str

    @property
    def is_identity_token(self) -> bool:
        return self.username == ""

    def basic(self) -> str:
        raw = f"{self.username}:{self.secret}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")

    def __repr__(self) -> str:  # never log secrets
        return f"Credentials(username={self.username!r}, secret=<redacted>)"


def credential_keys(host: str) -> list[str]:
    """Keys under which docker config may hold credentials for `host`."""
    if host in _DOCKER_HUB_HOSTS:
        return [DOCKER_HUB_KEY, *_DOCKER_HUB_HOSTS]
    return [host]


def _hostname_of_key(key: str) -> str:
    for prefix in ("http://", "https://"):
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key.split("/", 1)[0]


class CredentialStore:
    """Credentials from a docker config.json (re-read when its mtime changes), cached per host."""

    def __init__(self, config_file: Path | None) -> None:
        self._path = config_file
        self._mtime: float | None = None
        self._doc: Mapping[str, object] = {}
        self._helper_cache: dict[tuple[str, str], Credentials | None] = {}

    def _load(self) -> Mapping[str, object]:
        if self._path is None:
            return {}
        try:
            mtime = self._path.stat().st_mtime
        except FileNotFoundError:
            return {}
        if mtime != self._mtime:
            try:
                doc = json.loads(self._path.read_text())
            except (OSError, ValueError) as e:
                raise AuthError(f"cannot read docker config {self._path}: {e}") from e
            self._doc = doc if isinstance(doc, dict) else {}
            self._mtime = mtime
            self._helper_cache.clear()
        return self._doc

    async def get(self, host: str) -> Credentials | None:
        doc = self._load()
        keys = credential_keys(host)
        helpers = doc.get("credHelpers")
        if isinstance(helpers, dict):
            for key in keys:
                if isinstance(helpers.get(key), str):
                    return await self._run_helper(helpers[key], key)
        auths = doc.get("auths")
        if isinstance(auths, dict):
            entry = next((auths[k] for k in keys if isinstance(auths.get(k), dict)), None)
            if entry is None:
                # Legacy keys carry scheme and path ("https://host/v1/").
                entry = next((v for k, v in auths.items()
                              if isinstance(v, dict) and _hostname_of_key(k) in keys), None)
            if entry is not None:
                creds = _from_auth_entry(entry, host)
                if creds is not None:
                    return creds
        store = doc.get("credsStore")
        if isinstance(store, str) and store:
            return await self._run_helper(store, keys[0])
        return None

    async def _run_helper(self, name: str, server: str) -> Credentials | None:
        cache_key = (name, server)
        if cache_key in self._helper_cache:
            return self._helper_cache[cache_key]
        program = f"docker-credential-{name}"
        try:
            with trio.fail_after(HELPER_TIMEOUT):
                proc = await trio.run_process(
                    [program, "get"], stdin=server.encode(), capture_stdout=True,
                    capture_stderr=True, check=False,
                )
        except (OSError, trio.TooSlowError) as e:
            raise AuthError(f"credential helper {program} for {server}: {e!r}") from e
        if proc.returncode != 0:
            msg = (proc.stdout + proc.stderr).decode(errors="replace").strip()
            if "credentials not found" in msg.lower():
                self._helper_cache[cache_key] = None
                return None
            raise AuthError(f"credential helper {program} for {server} exited {proc.returncode}: {msg}")
        try:
            out = json.loads(proc.stdout)
            user, secret = str(out.get("Username", "")), str(out["Secret"])
        except (ValueError, KeyError, AttributeError) as e:
            raise AuthError(f"credential helper {program} for {server}: bad output ({e!r})") from e
        creds = Credentials("" if user == "<token>" else user, secret)
        self._helper_cache[cache_key] = creds
        return creds


def _from_auth_entry(entry: Mapping[str, object], host: str) -> Credentials | None:
    token = entry.get("identitytoken")
    if isinstance(token, str) and token:
        return Credentials("", token)
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            name, sep, pw = base64.b64decode(auth, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError) as e:
            raise AuthError(f"docker config: invalid base64 `auth` for {host}") from e
        if not sep:
            raise AuthError(f"docker config: `auth` for {host} is not user:password")
        return Credentials(name, pw)
    user, password = entry.get("username"), entry.get("password")
    if isinstance(user, str) and isinstance(password, str) and user:
        return Credentials(user, password)
    return None


@dataclass
class _Token:
    value: str
    expires_at: float  # trio clock
    expires_wall: float = -math.inf  # time.time(), for a hand-off to another process (never handed: -inf)


class Authorizer:
    """Computes Authorization headers per host and scope; see the module docstring."""

    def __init__(self, credentials: CredentialStore, *, expiry_margin: float = 10.0,
                 user_agent: str = "snapshotter") -> None:
        self._creds = credentials
        self._margin = expiry_margin
        self._user_agent = user_agent
        self._challenges: dict[str, Challenge] = {}
        self._tokens: dict[tuple[str, str, str, str], _Token] = {}
        self._locks: dict[tuple[str, str, str, str], trio.Lock] = {}
        self.tokens_fetched = 0

    def challenge_for(self, host: str) -> Challenge | None:
        return self._challenges.get(host)

    def handoff(self, scopes: Iterable[str]) -> dict[str, Any]:
        """What `adopt` in another process needs to authorize requests as this one does (see the
        module docstring): every host's challenge, and the tokens for exactly one of `scopes`
        that have at least HANDOFF_MIN_SECONDS to live. JSON-ready; {} when nothing was learned.
        Safe to call from any thread: it copies the tables first."""
        challenges = dict(self._challenges)
        if not challenges:
            return {}
        tokens = list(self._tokens.items())
        wanted = set(scopes)
        now = time.time()
        return {
            "challenges": {host: {"scheme": ch.scheme, "params": dict(ch.params)} for host, ch in challenges.items()},
            "tokens": [{"realm": realm, "service": service, "scope": scope, "username": user, "token": tok.value,
                        "expires": tok.expires_wall}
                       for (realm, service, scope, user), tok in tokens
                       if scope in wanted and tok.expires_wall - now >= HANDOFF_MIN_SECONDS],
        }

    def adopt(self, doc: Mapping[str, Any]) -> int:
        """Take over another process's `handoff` (in this process's trio run). What is malformed
        or expired is skipped: the requests then authenticate as if nothing was handed over.
        Returns the number of tokens taken."""
        challenges = doc.get("challenges")
        for host, ch in challenges.items() if isinstance(challenges, Mapping) else ():
            if not (isinstance(host, str) and isinstance(ch, Mapping) and isinstance(ch.get("scheme"), str)):
                continue
            params = ch.get("params")
            if isinstance(params, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in params.items()):
                self._challenges.setdefault(host, Challenge(ch["scheme"], MappingProxyType(dict(params))))
        taken = 0
        tokens = doc.get("tokens")
        now_wall, now = time.time(), trio.current_time()
        for t in tokens if isinstance(tokens, list) else ():
            if not isinstance(t, Mapping):
                continue
            realm, service, scope, user = (t.get(k) for k in ("realm", "service", "scope", "username"))
            value, expires = t.get("token"), t.get("expires")
            if not (isinstance(realm, str) and isinstance(service, str) and isinstance(scope, str)
                    and isinstance(user, str) and isinstance(value, str) and value
                    and isinstance(expires, (int, float)) and math.isfinite(expires) and expires > now_wall):
                continue
            key = (realm, service, scope, user)
            if key not in self._tokens:
                self._tokens[key] = _Token(value, now + (expires - now_wall), float(expires))
                taken += 1
        return taken

    async def authorization(self, host: str, scope: str, client: httpx.AsyncClient) -> str | None:
        """The Authorization value for a request to `host` needing `scope`, or None."""
        ch = self._challenges.get(host)
        if ch is None:
            return None
        creds = await self._creds.get(host)
        if ch.scheme == "basic":
            return creds.basic() if creds is not None and not creds.is_identity_token else None
        realm = ch.params.get("realm")
        if not realm:
            raise AuthError(f"registry {host}: bearer challenge without a realm")
        service = ch.params.get("service", "")
        scopes = scope or ch.params.get("scope", "")
        key = (realm, service, scopes, creds.username if creds else "")
        tok = self._tokens.get(key)
        if tok is not None and trio.current_time() < tok.expires_at:
            return f"Bearer {tok.value}"
        lock = self._locks.setdefault(key, trio.Lock())
        async with lock:
            tok = self._tokens.get(key)
            if tok is None or trio.current_time() >= tok.expires_at:
                tok = await self._fetch_token(host, realm, service, scopes.split(), creds, client)
                self._tokens[key] = tok
        return f"Bearer {tok.value}"

    def on_unauthorized(self, host: str, www_authenticate: Sequence[str], rejected: str | None) -> bool:
        """Learn from a 401. Returns True when a retry with (new) authorization makes sense."""
        challenges = parse_www_authenticate(www_authenticate)
        ch = next((c for c in challenges if c.scheme == "bearer"), None) or next(
            (c for c in challenges if c.scheme == "basic"), None)
        if ch is None:
            return False
        self._challenges[host] = ch
        if rejected and rejected.startswith("Bearer "):
            value = rejected[len("Bearer "):]
            for key, tok in list(self._tokens.items()):
                if tok.value == value:
                    del self._tokens[key]
        # Basic credentials that were just rejected will not improve on a retry.
        return not (ch.scheme == "basic" and rejected is not None and rejected.startswith("Basic "))

    async def _fetch_token(self, host: str, realm: str, service: str, scopes: list[str],
                           creds: Credentials | None, client: httpx.AsyncClient) -> _Token:
        headers = {"User-Agent": self._user_agent}
        try:
            if creds is not None and creds.is_identity_token:
                form = {"grant_type": "refresh_token", "refresh_token": creds.secret,
                        "service": service, "client_id": self._user_agent}
                if scopes:
                    form["scope"] = " ".join(scopes)
                resp = await client.post(realm, data=form, headers=headers)
            else:
                params: list[tuple[str, str | int | float | bool | None]] = []
                if service:
                    params.append(("service", service))
                params += [("scope", s) for s in scopes]
                if creds is not None:
                    headers["Authorization"] = creds.basic()
                resp = await client.get(realm, params=params, headers=headers)
        except httpx.HTTPError as e:
            raise AuthError(f"registry {host}: token request to {realm} failed: {e!r}", retryable=True) from e
        if resp.status_code != 200:
            raise AuthError(
                f"registry {host}: token server {realm} answered {resp.status_code}",
                retryable=resp.status_code >= 500 or resp.status_code == 429,
            )
        if len(resp.content) > MAX_TOKEN_RESPONSE:
            raise AuthError(f"registry {host}: token response from {realm} too large")
        try:
            body = resp.json()
            value = body.get("access_token") or body.get("token")
            lifetime = float(body.get("expires_in") or DEFAULT_TOKEN_LIFETIME)
        except (ValueError, AttributeError, TypeError) as e:
            raise AuthError(f"registry {host}: bad token response from {realm}: {e!r}") from e
        if not isinstance(value, str) or not value:
            raise AuthError(f"registry {host}: token server {realm} returned no token")
        if not math.isfinite(lifetime) or lifetime <= 0:
            lifetime = DEFAULT_TOKEN_LIFETIME
        self.tokens_fetched += 1
        log.debug("registry %s: got token for %s (expires in %.0fs)", host, " ".join(scopes), lifetime)
        life = max(lifetime - self._margin, 0.0)
        return _Token(value, trio.current_time() + life, time.time() + life)
