"""A TCP proxy that adds latency, for benchmarking over a slow network (this kernel lacks netem).

    python -m integration.bench.netproxy --listen 127.0.0.1:0 --upstream 127.0.0.1:5000 \
        --rtt-ms 50 --port-file PORTFILE --stats-file STATS

Model: every piece of data is held back rtt/2 in each direction before it is forwarded, in order,
as a link with that one-way delay would (bandwidth is not limited; data queued in flight is
bounded per direction, so a slow reader pushes back). Every request/response exchange therefore
costs at least one extra `rtt`. The TCP handshake to the proxy itself is not delayed, but each
new connection's first request is, as it would be.

The listening port is written to `--port-file` once the proxy accepts connections. On SIGTERM or
SIGINT the proxy writes `{"upstream_bytes": N, "client_bytes": M, "connections": C}` to
`--stats-file` (bytes sent by the upstream to clients and by clients upstream) and exits 0.
`--stats-file` is also rewritten after every closed connection, so a reader can diff it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

PIECE = 256 * 1024
IN_FLIGHT_PIECES = 256  # up to 64 MiB held per direction


class Stats:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.upstream_bytes = 0
        self.client_bytes = 0
        self.connections = 0

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"upstream_bytes": self.upstream_bytes, "client_bytes": self.client_bytes,
                                   "connections": self.connections}))
        tmp.replace(self.path)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                count: list[int]) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(IN_FLIGHT_PIECES)

    async def receive() -> None:
        try:
            while data := await reader.read(PIECE):
                await queue.put((time.monotonic() + delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put((time.monotonic() + delay, b""))

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            count[0] += len(data)
            await writer.drain()

    recv_task = asyncio.create_task(receive())
    try:
        await send()
    except (ConnectionError, OSError):
        recv_task.cancel()
    finally:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await recv_task


async def serve(listen: tuple[str, int], upstream: tuple[str, int], rtt: float, stats: Stats,
                port_file: Path | None) -> None:
    one_way = rtt / 2

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        stats.connections += 1
        try:
            u_reader, u_writer = await asyncio.open_connection(*upstream)
        except OSError:
            c_writer.close()
            return
        up = [0]
        down = [0]
        try:
            await asyncio.gather(_pipe(c_reader, u_writer, one_way, up), _pipe(u_reader, c_writer, one_way, down))
        except asyncio.CancelledError:  # shutting down with the connection open
            pass
        finally:
            stats.client_bytes += up[0]
            stats.upstream_bytes += down[0]
            for w in (u_writer, c_writer):
                w.close()
            stats.write()

    server = await asyncio.start_server(handle, *listen, limit=PIECE * 4)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stats.write()
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(port_file)
    async with server:
        await stop.wait()
    stats.write()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.bench.netproxy", description=__doc__.split("\n")[0])
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--upstream", required=True)
    p.add_argument("--rtt-ms", type=float, required=True)
    p.add_argument("--port-file", type=Path)
    p.add_argument("--stats-file", type=Path)
    a = p.parse_args(argv)
    asyncio.run(serve(_addr(a.listen), _addr(a.upstream), a.rtt_ms / 1000, Stats(a.stats_file), a.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
