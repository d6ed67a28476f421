"""The `snapshotter` command: serve (the daemon) and the tools around it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from snapshotter import __version__
from snapshotter.config import DEFAULT_CONFIG_PATH, Config, load_config
from snapshotter.errors import SnapshotterError

Command = Callable[[argparse.Namespace], int]


def _serve(args: argparse.Namespace) -> int:
    from snapshotter import daemon
    from snapshotter.logs import setup_logging
    from snapshotter.memory import DAEMON, tune_malloc

    tune_malloc(DAEMON)  # before gRPC starts its threads

    config = load_config(args.config, required=args.config is not None)
    overrides: dict[str, object] = {}
    if args.root is not None:
        overrides["root"] = str(args.root)
    if args.address is not None:
        overrides["address"] = str(args.address)
    if args.log_level is not None:
        overrides["log_level"] = args.log_level
    if args.containerd_address is not None:
        overrides["containerd_address"] = args.containerd_address
    config = config.replace(**overrides) if overrides else config
    setup_logging(config.log_level, config.log_format)
    return daemon.run(config)


def _status(args: argparse.Namespace) -> int:
    import json

    from snapshotter.status import admin_socket_path, fetch_status, render_text

    address = args.address
    if address is None:
        address = Path(load_config(args.config, required=args.config is not None).address)
    admin = admin_socket_path(address)
    try:
        doc = fetch_status(admin)
    except (OSError, ValueError) as exc:
        print(f"snapshotter status: cannot ask the daemon on {admin}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(doc))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from snapshotter.inspect import inspect

    config = load_config(args.config, required=args.config is not None)
    json.dump(inspect(args.target, config), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from snapshotter.convert import ConvertOptions, convert, read_prefetch_list
    from snapshotter.remote.settings import fetch_config_from

    config = load_config(args.config, required=args.config is not None)
    prefetch = read_prefetch_list(args.prefetch_list) if args.prefetch_list is not None else None
    options = ConvertOptions(format=args.format, chunk_size=args.chunk_size, prefetch=prefetch,
                             plain_http=args.plain_http)
    result = convert(args.src, args.dst, options, fetch_config_from(config))
    print(f"{args.dst} {result.digest}")
    return 0


def _record(args: argparse.Namespace) -> int:
    from snapshotter.record import RecordOptions, record, write_profile

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    opts = RecordOptions(ref=args.ref, command=command, address=args.address, namespace=args.namespace,
                         snapshotter=args.snapshotter, plain_http=args.plain_http, timeout=args.timeout,
                         run_args=tuple(args.run_arg))
    result = record(opts)
    write_profile(result.paths, args.output)
    for warning in result.warnings:
        print(f"snapshotter record: warning: {warning}", file=sys.stderr)
    status = "killed at the timeout" if result.timed_out else f"exit status {result.exit_status}"
    print(f"snapshotter record: {len(result.paths)} files read ({status})"
          + (f", written to {args.output}" if args.output else ""), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapshotter", description="A lazy-pulling containerd snapshotter.")
    parser.add_argument("--version", action="version", version=f"snapshotter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon (containerd proxy plugin 'lazy')")
    serve.add_argument("--root", type=Path, help=f"state directory (default {Config.root})")
    serve.add_argument("--address", type=Path, help=f"gRPC unix socket (default {Config.address})")
    serve.add_argument("--config", type=Path, help=f"TOML config file (default {DEFAULT_CONFIG_PATH} if present)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--containerd-address", metavar="SOCKET",
                       help=f"containerd's socket, for its container events ('' = none; default "
                            f"{Config.containerd_address})")
    serve.set_defaults(func=_serve)

    insp = sub.add_parser("inspect", help="print a layer's (or every layer of an image's) index as JSON")
    insp.add_argument("target", metavar="FILE_OR_REF", help="a layer blob, a Nydus bootstrap, or an image ref")
    insp.add_argument("--config", type=Path, help="config file (registry hosts, credentials, limits)")
    insp.set_defaults(func=_inspect)

    conv = sub.add_parser("convert", help="convert an image to eStargz, zstd:chunked or Nydus",
                          description="SRC and DST: a registry reference (HOST[:PORT]/REPO:TAG) or oci:DIR[:TAG].")
    conv.add_argument("--format", required=True, choices=["estargz", "zstdchunked", "nydus"])
    conv.add_argument("--prefetch-list", type=Path, metavar="FILE",
                      help="paths to prefetch, one per line (as `snapshotter record` writes)")
    conv.add_argument("--chunk-size", type=int, metavar="N",
                      help="chunk size in bytes (default: 4 MiB eStargz/zstd:chunked, 1 MiB Nydus)")
    conv.add_argument("--plain-http", action="store_true", help="talk plain HTTP to the registries")
    conv.add_argument("--config", type=Path, help="config file (registry hosts, credentials, limits)")
    conv.add_argument("src", metavar="SRC")
    conv.add_argument("dst", metavar="DST")
    conv.set_defaults(func=_convert)

    rec = sub.add_parser(
        "record", help="run a command in a container of an image and write the files it read (a prefetch profile)",
        usage="snapshotter record [options] REF -- CMD [ARGS...]",
        description="Pull REF lazily through containerd and our snapshotter, run CMD in a container of it "
                    "(bounded by --timeout), and write the files it read, first read first, one path per line: "
                    "the profile `snapshotter convert --prefetch-list` takes. REF's layers must be lazy "
                    "(eStargz, zstd:chunked or Nydus).")
    rec.add_argument("--timeout", type=float, default=30.0, metavar="S",
                     help="seconds the command may run; then it is killed and its reads so far recorded (default 30)")
    rec.add_argument("--output", "-o", type=Path, metavar="FILE", help="profile file (default: stdout)")
    rec.add_argument("--address", default="/run/containerd/containerd.sock", help="containerd's socket")
    rec.add_argument("--namespace", "-n", default="default", help="containerd namespace (default 'default')")
    rec.add_argument("--snapshotter", default="lazy", help="containerd's name for our snapshotter (default 'lazy')")
    rec.add_argument("--plain-http", action="store_true", help="pull over plain HTTP")
    rec.add_argument("--run-arg", action="append", default=[], metavar="FLAG",
                     help="extra `ctr run` flag, e.g. --run-arg=--runc-root=/run/r (repeatable)")
    rec.add_argument("ref", metavar="REF")
    rec.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="command and arguments")
    rec.set_defaults(func=_record)
    status = sub.add_parser("status", help="what the running daemon serves: per image and layer, lazy or not")
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.add_argument("--address", type=Path,
                        help=f"the daemon's gRPC socket; its admin socket is ADDRESS.admin (default {Config.address})")
    status.add_argument("--config", type=Path, help="config file naming the address")
    status.set_defaults(func=_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command = args.func
    try:
        return func(args)
    except SnapshotterError as exc:
        print(f"snapshotter {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
