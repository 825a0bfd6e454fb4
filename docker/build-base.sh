#!/usr/bin/env bash
# Builds a Debian bookworm base image from Debian's packages, for hosts that reach Debian's mirror but no container
# registry (so `FROM python:3.11-slim` cannot be pulled). Usage: docker/build-base.sh [IMAGE] (default
# rollout-svc-base:bookworm); does nothing if IMAGE exists. Needs root and a Docker engine; installs debootstrap
# if missing. ~2 minutes, ~80 MB compressed. Then: ROLLOUT_BASE_IMAGE=IMAGE for docker-compose.yml's builds.
set -euo pipefail
image=${1:-rollout-svc-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image exists"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
rm -f "$root.log"
# As Docker's official Debian images: no package lists or caches in the image, apt sources of the same mirror.
echo "deb $mirror bookworm main" >"$root/etc/apt/sources.list"
echo "deb $mirror bookworm-updates main" >>"$root/etc/apt/sources.list"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  -c 'CMD ["bash"]' - "$image" >/dev/null
echo "built base image $image from Debian bookworm ($mirror)"
