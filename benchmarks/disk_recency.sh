#!/usr/bin/env bash
# Does this disk read recently written data faster than older data? On a virtual disk whose host
# caches writes (the GPU VM's /dev/vda), a guest's drop_caches does not reach that cache, so "cold"
# O_DIRECT reads of data written a minute ago can be served from the host's memory. Two backends
# compared on one disk then differ by which of them wrote last, not by their read paths.
#
#   bash benchmarks/disk_recency.sh DIR [OLD_GIB] [NEW_GIB]     # defaults 4 and 24
#
# Writes OLD_GIB to old.bin, then NEW_GIB to new.bin (O_DIRECT, random data), drops the guest's page
# cache, and reads back with O_DIRECT (bs 4 MiB): all of old.bin, the first and the last OLD_GIB of
# new.bin. If the last-written part reads much faster than the two older ones, recency matters.
# Removes both files. Needs root for drop_caches (else the numbers include the guest's cache).
set -euo pipefail
DIR=${1:?usage: $0 DIR [OLD_GIB] [NEW_GIB]}
OLD=${2:-4}
NEW=${3:-24}
mkdir -p "$DIR"
SRC=$(mktemp -p /dev/shm recency.XXXXXX)
trap 'rm -f "$SRC" "$DIR/old.bin" "$DIR/new.bin"' EXIT
head -c $((1 << 30)) /dev/urandom > "$SRC"
write() {  # file, GiB
  for i in $(seq 0 $(($2 - 1))); do
    dd if="$SRC" of="$1" bs=4M count=256 seek=$((i * 256)) oflag=direct conv=notrunc status=none
  done
}
rate() {  # file, skip (4 MiB blocks), count
  dd if="$1" of=/dev/null bs=4M skip="$2" count="$3" iflag=direct 2>&1 | awk '/copied/ {print $(NF-1), $NF}'
}
t=$(date +%s.%N); write "$DIR/old.bin" "$OLD"; echo "wrote old.bin $OLD GiB in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}") s"
t=$(date +%s.%N); write "$DIR/new.bin" "$NEW"; echo "wrote new.bin $NEW GiB in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}") s"
sync
echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(no drop_caches: not root)"
n=$((OLD * 256))
echo "read old.bin (written first):          $(rate "$DIR/old.bin" 0 $n)"
echo "read new.bin, first $OLD GiB:            $(rate "$DIR/new.bin" 0 $n)"
echo "read new.bin, last $OLD GiB (newest):    $(rate "$DIR/new.bin" $(((NEW - OLD) * 256)) $n)"
echo "read old.bin again:                     $(rate "$DIR/old.bin" 0 $n)"
