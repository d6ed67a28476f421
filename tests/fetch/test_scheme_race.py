"""A loopback registry's scheme is learned without a round trip of its own: the first request
goes out over TLS and plain HTTP at once (client.py `_tls_or_plain`), against real registries
behind a TCP relay that sees which scheme each connection speaks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from snapshotter.fetch import RegistryClient
from tests.fetch.conftest import FAST
from tests.fetch.registry import PushedImage, RegistryProcess, make_self_signed, push_image, start_registry

TLS_RECORD_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello
WAIT = 10.0  # seconds any relay wait may take before the test fails


class SchemeRelay:
    """Relays TCP connections to `upstream` (host:port) and records the scheme of each one by
    its first byte. With hold_tls, a TLS connection is relayed only once a plain one has come
    (or after WAIT seconds): a client that tries TLS first and plain HTTP only after TLS failed
    is held the full WAIT (and `plain_while_tls_held` stays False)."""

    def __init__(self, upstream: str, *, hold_tls: bool = False, stall_tls: bool = False) -> None:
        self.upstream = upstream
        self.hold_tls = hold_tls
        self.stall_tls = stall_tls  # a TLS connection gets no answer at all until the relay closes
        self.tls_stalled = threading.Event()
        self.schemes: list[str] = []
        self.plain_seen = threading.Event()
        self.plain_while_tls_held = False
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(WAIT)
            try:
                first = conn.recv(1, socket.MSG_PEEK)
            except OSError:
                return
            if not first:
                return
            tls = first[0] == TLS_RECORD_HANDSHAKE
            with self._lock:
                self.schemes.append("tls" if tls else "plain")
            if not tls:
                self.plain_seen.set()
            elif self.stall_tls:
                self.tls_stalled.set()
                self._stop.wait(WAIT)
                return
            elif self.hold_tls and self.plain_seen.wait(WAIT):
                self.plain_while_tls_held = True
            host, port = self.upstream.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=WAIT) as up:
                back = threading.Thread(target=_copy, args=(up, conn), daemon=True)
                back.start()
                _copy(conn, up)
                back.join(timeout=WAIT)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _ref_via(relay: SchemeRelay, image: PushedImage) -> str:
    return image.ref.replace(image.registry, relay.host, 1)


@pytest.fixture(scope="module")
def tls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RegistryProcess, PushedImage]]:
    d: Path = tmp_path_factory.mktemp("race-tls-registry")
    cert, key = make_self_signed(d)
    reg = start_registry(d / "reg", tls=(cert, key))
    try:
        yield reg, push_image(reg.url, "race/app", "v1", [b"tls-bytes" * 500])
    finally:
        reg.stop()


def test_plain_registry_is_asked_over_plain_http_while_tls_is_still_trying(image: PushedImage) -> None:
    """Against a plain-HTTP loopback registry the plain request goes out before the TLS attempt
    has failed (the relay holds the TLS one until a plain one came): the answer comes from the
    plain request, with no retry, and the host is remembered as plain."""
    digest, data = min(image.layers.items(), key=lambda kv: len(kv[1]))
    relay = SchemeRelay(image.registry, hold_tls=True)
    try:
        async def main() -> None:
            async with RegistryClient(FAST) as c:
                assert await c.read_range(_ref_via(relay, image), digest, 5, 50) == data[5:55]
                assert c.stats.retries == 0
                assert c.plain_http_hosts() == frozenset({relay.host})
                # Known now: the next request goes straight to plain HTTP.
                assert await c.read_range(_ref_via(relay, image), digest, 0, 10) == data[:10]

        trio.run(main)
    finally:
        relay.close()
    assert relay.plain_while_tls_held, "the plain request was sent only after TLS had failed"
    assert relay.schemes.count("tls") == 1, relay.schemes


def test_a_plain_answer_with_the_data_is_used_without_waiting_for_tls_to_fail(image: PushedImage) -> None:
    """A port that answers the plain request with the data speaks plain HTTP: its answer is used
    at once, while the TLS attempt still waits for a handshake that never comes (a TLS port
    answers a plain request with a 400, which would leave the choice to TLS)."""
    digest, data = min(image.layers.items(), key=lambda kv: len(kv[1]))
    relay = SchemeRelay(image.registry, stall_tls=True)
    stalled_at_answer: list[bool] = []
    try:
        async def main() -> None:
            async with RegistryClient(FAST) as c:
                assert await c.read_range(_ref_via(relay, image), digest, 7, 40) == data[7:47]
                stalled_at_answer.append(relay.tls_stalled.is_set() and not relay._stop.is_set())
                assert c.plain_http_hosts() == frozenset({relay.host}) and c.stats.retries == 0

        trio.run(main)
    finally:
        relay.close()
    assert stalled_at_answer == [True], "the answer waited for the TLS attempt to end"
    assert relay.schemes.count("tls") == 1, relay.schemes


def test_tls_registry_keeps_tls_and_is_not_raced_again(tls_registry: tuple[RegistryProcess, PushedImage]) -> None:
    """Against a TLS loopback registry the TLS answer wins (the plain request's 400 is dropped),
    the host is not taken for plain HTTP, and later requests go over TLS alone."""
    reg, img = tls_registry
    digest, data = next(iter(img.layers.items()))
    relay = SchemeRelay(reg.host)
    try:
        async def main() -> None:
            async with RegistryClient(FAST) as c:
                for offset in (3, 100, 200):
                    assert await c.read_range(_ref_via(relay, img), digest, offset, 9) == data[offset:offset + 9]
                assert c.plain_http_hosts() == frozenset()
                assert c.stats.retries == 0

        trio.run(main)
    finally:
        relay.close()
    assert relay.schemes.count("plain") == 1, relay.schemes  # the first request's race only
    assert "tls" in relay.schemes
