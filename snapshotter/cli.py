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

    config = load_config(args.config, required=args.config is not None)
    overrides: dict[str, object] = {}
    if args.root is not None:
        overrides["root"] = str(args.root)
    if args.address is not None:
        overrides["address"] = str(args.address)
    if args.log_level is not None:
        overrides["log_level"] = args.log_level
    config = config.replace(**overrides) if overrides else config
    setup_logging(config.log_level, config.log_format)
    return daemon.run(config)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snapshotter", description="A lazy-pulling containerd snapshotter.")
    parser.add_argument("--version", action="version", version=f"snapshotter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon (containerd proxy plugin 'lazy')")
    serve.add_argument("--root", type=Path, help=f"state directory (default {Config.root})")
    serve.add_argument("--address", type=Path, help=f"gRPC unix socket (default {Config.address})")
    serve.add_argument("--config", type=Path, help=f"TOML config file (default {DEFAULT_CONFIG_PATH} if present)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
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
