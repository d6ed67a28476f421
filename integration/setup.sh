#!/usr/bin/env bash
# Installs the system packages the local lab (integration/lab.py) needs, as root on Debian 12.
# Idempotent: when every package is already installed it does nothing (no apt-get update),
# so re-runs take well under a second. The venv and generated protos are made by ./ci, not here.
set -euo pipefail

PACKAGES=(
  containerd runc            # containerd 1.6 + the OCI runtime its runc shim calls
  fuse3 libfuse3-dev pkg-config   # fusermount3, and what pyfuse3 needs to build in the venv
  docker-registry            # the distribution registry (`docker-registry serve cfg.yml`)
  skopeo umoci               # push OCI layouts to the registry; optional layout tooling
  busybox-static             # the static binary our test images are built from
  debootstrap                # Debian rootfs for the benchmark images (integration/bench)
  erofs-utils                # mkfs.erofs / dump.erofs for Nydus RAFS v6 checks
  stargz-snapshotter         # ctr-remote: eStargz / zstd:chunked conversion and rpull
  iproute2 curl              # tc for bandwidth shaping; registry probes
  util-linux                 # mount, umount, findmnt
  ca-certificates
  systemd                    # systemd-analyze verify and systemd-tmpfiles check our unit files (tests/ops)
  lz4                        # the reference LZ4 tool, an oracle for our LZ4 block decoder
  golang-go golang-github-containerd-stargz-snapshotter-dev   # builds stargz's own Go reader as an interop oracle
)

if [[ $(id -u) -ne 0 ]]; then
  echo "setup.sh: must run as root" >&2
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  # dpkg-query prints "install ok installed" only for fully configured packages.
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

if (( ${#missing[@]} )); then
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y "${missing[@]}"
else
  echo "setup.sh: all lab packages present"
fi

# The lab runs as root with FUSE; fail early and clearly when the machine can't.
if [[ ! -c /dev/fuse ]]; then
  echo "setup.sh: /dev/fuse is missing (modprobe fuse?)" >&2
  exit 1
fi
for bin in containerd ctr runc containerd-shim-runc-v2 docker-registry skopeo busybox fusermount3 ctr-remote; do
  command -v "$bin" >/dev/null || PATH="$PATH:/usr/sbin:/sbin" command -v "$bin" >/dev/null || {
    echo "setup.sh: $bin not found after install" >&2
    exit 1
  }
done
echo "setup.sh: ok"
