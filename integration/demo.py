"""Run it: bring the lab up, push a small multi-layer image, pull and run it through `lazy`.

    sudo .venv/bin/python -m integration.demo [--snapshotter overlayfs] [--keep]

Everything (registry, our daemon, containerd) runs under one temp dir and is stopped and removed
on exit; `--keep` leaves the dir (logs, snapshotter root) for a look afterwards.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from integration.lab import PROXY_NAME, Lab, LabError

SCRIPT = """\
echo "hello from a container on the '$SNAPSHOTTER' snapshotter"
echo "layer 1+2: $(cat /etc/layer1.txt)"
echo "layer 2:   $(cat /data/layer2.txt) (symlink -> $(readlink /data/layer2-sym))"
echo "layer 3:   $(cat /etc/layer3.txt); /etc/doomed.txt $( [ -e /etc/doomed.txt ] && echo present || echo deleted)"
echo "opaque:    /opaque holds: $(ls /opaque | tr '\\n' ' ')"
echo "layer 4:   $(sha256sum /big/blob.bin)"
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--snapshotter",
        default=PROXY_NAME,
        help=f"'{PROXY_NAME}' (ours, default) or a built-in one such as 'overlayfs'",
    )
    parser.add_argument("--keep", action="store_true", help="keep the lab dir (logs) after exit")
    args = parser.parse_args(argv)

    t0 = time.monotonic()

    def step(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.2f}s] {msg}", flush=True)

    try:
        with Lab(start_daemon=args.snapshotter == PROXY_NAME, keep=args.keep) as lab:
            step(f"lab up in {lab.dir}: registry {lab.registry_host}, containerd {lab.containerd_socket}")
            image = lab.foundation_image()
            step(f"built {image.tag}: {len(image.layers)} layers, manifest {image.manifest_digest[:19]}")
            ref = lab.push(image, "demo")
            step(f"pushed {ref}")
            lab.pull(ref, snapshotter=args.snapshotter)
            step(f"pulled with --snapshotter {args.snapshotter}")
            print(lab.ctr("snapshots", "--snapshotter", args.snapshotter, "tree").stdout, end="")
            r = lab.ctr_run(
                ref,
                f"demo-{uuid.uuid4().hex[:8]}",
                "sh",
                "-c",
                SCRIPT,
                snapshotter=args.snapshotter,
                extra=["--env", f"SNAPSHOTTER={args.snapshotter}"],
                timeout=120,
            )
            step("container output:")
            print(r.stdout, end="")
            if r.stderr.strip():
                print(r.stderr, end="", file=sys.stderr)
            if args.keep:
                step(f"kept {lab.dir} (logs in {lab.logs_dir})")
        step("lab stopped")
    except LabError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
