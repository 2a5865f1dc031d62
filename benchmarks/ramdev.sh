#!/usr/bin/env bash
# A fast device anyone can make: RAM-backed ext4 file systems on loop devices, for benchmarks that
# need an NVMe-class read rate on a machine that has none.
#
#   sudo bash benchmarks/ramdev.sh up --size 8G [--count 4] [--root /mnt/hicache-ram]
#   sudo bash benchmarks/ramdev.sh status [--root ...]
#   sudo bash benchmarks/ramdev.sh down [--root ...]
#
# `up` mounts one tmpfs of COUNT x SIZE (+ 64 MiB per device for ext4's own metadata) at
# ROOT/backing, makes COUNT files of SIZE in it, attaches each to a loop device, formats it ext4
# and mounts it `noatime` at ROOT/dev<i> (mode 0700). It prints, on its last line, the mount points
# comma-separated: what `GDS_PATH` takes. tmpfs alone refuses O_DIRECT; a loop device over a tmpfs
# file accepts it, so every O_DIRECT path (hicache-gds, HiCacheNixl, fio) runs on it unchanged.
# The memory is taken as the device is written: SIZE x COUNT must fit in free RAM.
#
# `status` prints, per device: mount point, loop device, and its sectors read and written
# (/sys/block/<loop>/stat fields 3 and 7): what a harness polls to know when write-back has drained
# (`du` cannot tell for slab files, which are preallocated).
#
# `down` unmounts, detaches and frees everything `up` made under ROOT, and only that (it reads the
# loop devices back from the mounts). Run it on every exit path: a forgotten device holds its RAM.
set -euo pipefail

usage() { { echo "ramdev: usage: ramdev.sh up --size SIZE [--count N] [--root DIR] | status [--root DIR] | down [--root DIR]"; sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; } >&2; exit 2; }
CMD=${1:-}; [ -n "$CMD" ] || usage; shift
SIZE= COUNT=1 ROOT=/mnt/hicache-ram
while [ $# -gt 0 ]; do
  case "$1" in
    --size) SIZE=$2; shift 2 ;;
    --count) COUNT=$2; shift 2 ;;
    --root) ROOT=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "ramdev: unknown argument '$1'" >&2; usage ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "ramdev: needs root (mount, losetup)" >&2; exit 1; }

bytes() {  # 8G / 512M / 1048576 -> bytes
  local v=${1^^}
  case "$v" in
    *[0-9]G) echo $(( ${v%G} << 30 )) ;; *[0-9]M) echo $(( ${v%M} << 20 )) ;;
    *[0-9]K) echo $(( ${v%K} << 10 )) ;; *[0-9]) echo "$v" ;;
    *) echo "ramdev: --size '$1' is not a size (e.g. 8G, 512M)" >&2; return 1 ;;
  esac
}

devices() {  # "<mountpoint> <loopdev>" for each device mounted under ROOT
  findmnt -rn -o TARGET,SOURCE | awk -v r="$ROOT/dev" 'index($1, r) == 1 && $2 ~ /^\/dev\/loop/ {print $1, $2}' | sort -V
}

case "$CMD" in
  up)
    [ -n "$SIZE" ] || { echo "ramdev: up needs --size (per device, e.g. 8G): sized explicitly, never by default" >&2; exit 2; }
    [[ "$COUNT" =~ ^[1-9][0-9]*$ ]] || { echo "ramdev: --count '$COUNT' must be a positive integer" >&2; exit 2; }
    per=$(bytes "$SIZE")
    [ "$per" -ge $((64 << 20)) ] || { echo "ramdev: --size $SIZE is below 64M" >&2; exit 2; }
    total=$(( COUNT * (per + (64 << 20)) ))
    avail=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) << 10 ))
    if [ "$total" -gt $(( avail * 9 / 10 )) ]; then
      echo "ramdev: $COUNT x $SIZE needs $((total >> 20)) MiB of RAM; $((avail >> 20)) MiB available" >&2; exit 1
    fi
    if mountpoint -q "$ROOT/backing" 2>/dev/null; then
      echo "ramdev: $ROOT/backing is already mounted; run 'down' first" >&2; exit 1
    fi
    mkdir -p "$ROOT/backing"
    mount -t tmpfs -o "size=$total,mode=0700" hicache-ram "$ROOT/backing"
    trap 'echo "ramdev: up failed; cleaning up" >&2; bash "$0" down --root "$ROOT" >&2 || true' ERR
    mounts=()
    for i in $(seq 0 $((COUNT - 1))); do
      img="$ROOT/backing/dev$i.img"
      truncate -s "$per" "$img"
      mkfs.ext4 -q -F -m 0 -E lazy_itable_init=0,lazy_journal_init=0 "$img"
      loop=$(losetup -f --show "$img")
      mkdir -p "$ROOT/dev$i"
      mount -o noatime "$loop" "$ROOT/dev$i"
      chmod 0700 "$ROOT/dev$i"
      mounts+=("$ROOT/dev$i")
      echo "ramdev: $ROOT/dev$i on $loop ($SIZE, RAM-backed ext4)" >&2
    done
    trap - ERR
    (IFS=,; echo "${mounts[*]}")
    ;;
  status)
    devices | while read -r mnt dev; do
      read -r _ _ rsec _ _ _ wsec _ < "/sys/block/$(basename "$dev")/stat"
      echo "$mnt $dev read_sectors=$rsec written_sectors=$wsec"
    done
    ;;
  down)
    devices | while read -r mnt dev; do
      umount "$mnt" && losetup -d "$dev" && rmdir "$mnt" || echo "ramdev: could not release $mnt ($dev)" >&2
    done
    # images whose mount is gone but whose loop device is still attached
    if [ -d "$ROOT/backing" ]; then
      for img in "$ROOT"/backing/*.img; do
        [ -e "$img" ] || continue
        losetup -j "$img" | cut -d: -f1 | while read -r dev; do losetup -d "$dev" || true; done
      done
      # a detached loop device lets go of its image only once nothing holds it open (udev's probe
      # after the umount may): wait for that, then free the tmpfs; lazily if it is still held
      for _ in $(seq 50); do
        mountpoint -q "$ROOT/backing" || break
        held=$(for img in "$ROOT"/backing/*.img; do [ -e "$img" ] && losetup -j "$img"; done)
        [ -z "$held" ] && umount "$ROOT/backing" 2>/dev/null && break
        sleep 0.2
      done
      if mountpoint -q "$ROOT/backing"; then
        echo "ramdev: $ROOT/backing still busy after 10 s; unmounted lazily (its memory is freed when released)" >&2
        umount -l "$ROOT/backing"
      fi
      rmdir "$ROOT/backing" 2>/dev/null || true
    fi
    rmdir "$ROOT" 2>/dev/null || true
    ;;
  *) usage ;;
esac
