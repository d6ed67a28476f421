import base64
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import trio

from snapshotter.fetch.auth import AuthError, Authorizer, Credentials, CredentialStore, parse_www_authenticate


def test_parse_challenges() -> None:
    (c,) = parse_www_authenticate(
        ['Bearer realm="https://auth.example.com/token",service="registry.example.com",'
         'scope="repository:a/b:pull,push"'])
    assert c.scheme == "bearer"
    assert dict(c.params) == {"realm": "https://auth.example.com/token", "service": "registry.example.com",
                              "scope": "repository:a/b:pull,push"}
    cs = parse_www_authenticate(['Basic realm="x \\"q\\"", Bearer realm=https://r,service=s', "Other"])
    assert [(c.scheme, dict(c.params)) for c in cs] == [
        ("basic", {"realm": 'x "q"'}), ("bearer", {"realm": "https://r", "service": "s"}), ("other", {})]
    assert parse_www_authenticate([""]) == []


def _store(tmp_path: Path, doc: dict[str, object]) -> CredentialStore:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(doc))
    return CredentialStore(f)


def test_auths_entries(tmp_path: Path) -> None:
    b64 = base64.b64encode(b"alice:s3cr:et").decode()
    store = _store(tmp_path, {"auths": {
        "r1.io": {"auth": b64},
        "https://r2.io/v1/": {"username": "bob", "password": "pw"},
        "r3.io": {"identitytoken": "refresh-me"},
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:hubpw").decode()},
        "r4.io": {"auth": "!!notbase64"},
    }})

    async def main() -> None:
        assert await store.get("r1.io") == Credentials("alice", "s3cr:et")
        assert await store.get("r2.io") == Credentials("bob", "pw")
        creds = await store.get("r3.io")
        assert creds is not None and creds.is_identity_token and creds.secret == "refresh-me"
        assert await store.get("registry-1.docker.io") == Credentials("hub", "hubpw")
        assert await store.get("nothing.io") is None
        with pytest.raises(AuthError, match="r4.io"):
            await store.get("r4.io")

    trio.run(main)
    assert "hubpw" not in repr(Credentials("hub", "hubpw"))


def test_cred_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "helper.log"
    helper = bindir / "docker-credential-fake"
    helper.write_text(
        "#!/bin/sh\n"
        f'read host; echo "$1 $host" >> {log}\n'
        'case "$host" in\n'
        '  tok.io) echo \'{"ServerURL":"tok.io","Username":"<token>","Secret":"idtok"}\' ;;\n'
        '  missing.io) echo "credentials not found in native keychain"; exit 1 ;;\n'
        '  broken.io) echo "boom" >&2; exit 3 ;;\n'
        '  *) printf \'{"ServerURL":"%s","Username":"u-%s","Secret":"p"}\' "$host" "$host" ;;\n'
        "esac\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    store = _store(tmp_path, {"credHelpers": {"h.io": "fake", "tok.io": "fake", "missing.io": "fake",
                                              "broken.io": "fake"},
                              "credsStore": "fake", "auths": {"h.io": {"auth": "eDp5"}}})

    async def main() -> None:
        assert await store.get("h.io") == Credentials("u-h.io", "p")  # credHelpers beat auths
        assert await store.get("h.io") == Credentials("u-h.io", "p")  # cached: helper ran once
        assert await store.get("tok.io") == Credentials("", "idtok")
        assert await store.get("missing.io") is None
        with pytest.raises(AuthError, match="exited 3: boom"):
            await store.get("broken.io")
        # credsStore is the fallback for hosts without a helper or auths entry.
        assert await store.get("other.io") == Credentials("u-other.io", "p")

    trio.run(main)
    assert log.read_text().splitlines() == ["get h.io", "get tok.io", "get missing.io", "get broken.io",
                                            "get other.io"]


def test_adopt_skips_what_is_malformed_or_expired() -> None:
    """A hand-off from another process is only an optimization: anything wrong in it is skipped."""
    good = {"realm": "https://auth.example/token", "service": "reg", "scope": "repository:app:pull",
            "username": "", "token": "t0k", "expires": time.time() + 300}

    async def main() -> None:
        a = Authorizer(CredentialStore(None))
        doc = {"challenges": {"reg.example": {"scheme": "bearer",
                                              "params": {"realm": good["realm"], "service": "reg"}},
                              "bad.example": {"scheme": 3}, "worse.example": "bearer"},
               "tokens": [good, {**good, "scope": "repository:other:pull", "expires": time.time() - 1},
                          {**good, "scope": "repository:x:pull", "token": ""}, {**good, "realm": None},
                          {**good, "expires": float("nan")}, "t0k", 7]}
        assert a.adopt(doc) == 1
        assert a.challenge_for("reg.example") is not None and a.challenge_for("bad.example") is None
        async with httpx.AsyncClient() as client:  # the token is served from the hand-off: no request
            assert await a.authorization("reg.example", "repository:app:pull", client) == "Bearer t0k"
        assert a.tokens_fetched == 0
        handed = a.handoff(["repository:app:pull"])
        assert handed["tokens"] == [good]  # and it can be handed on again
        assert a.adopt({"challenges": [], "tokens": {}}) == 0 and Authorizer(CredentialStore(None)).handoff([]) == {}

    trio.run(main)
