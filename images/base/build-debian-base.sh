#!/usr/bin/env bash
# Build a minimal Debian base image without any container registry:
# debootstrap a rootfs from the Debian package mirror, then `docker import` it.
#
#   usage: build-debian-base.sh [TAG] [SUITE]
#   default TAG: sandbox-kernel-base:bookworm, SUITE: bookworm
#
# The image has python3, pip and venv; the host's CA bundle is copied in so that
# pip inside `docker build` trusts the same TLS roots as the host (sites with a TLS
# intercepting proxy need that). Sites with a registry do not need this script:
# build images/Dockerfile with its default BASE instead.
set -euo pipefail
TAG="${1:-sandbox-kernel-base:bookworm}"
SUITE="${2:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

[ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "error: install debootstrap (apt-get install debootstrap)" >&2; exit 1; }

DIR="$(mktemp -d /tmp/sbk-rootfs.XXXXXX)"
trap 'rm -rf "$DIR"' EXIT

echo "==> debootstrap $SUITE into $DIR (about a minute)"
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
  "$SUITE" "$DIR" "$MIRROR" | grep -E '^I: (Retrieving|Validating|Installing|Configuring|Base system)' \
  | awk 'NR % 25 == 1 || /Base system/' || true
[ -x "$DIR/usr/bin/python3" ] || { echo "error: debootstrap failed (no python3 in rootfs)" >&2; exit 1; }

if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp /etc/ssl/certs/ca-certificates.crt "$DIR/etc/ssl/certs/ca-certificates.crt"
fi
rm -rf "$DIR"/var/cache/apt/archives/*.deb "$DIR"/var/lib/apt/lists/*

echo "==> docker import -> $TAG"
tar -C "$DIR" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$TAG"
echo "==> built $TAG"
