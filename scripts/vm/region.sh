# shellcheck shell=sh
# Helpers for guest jobs: raw 32-bit access to the shared region (the ivshmem BAR) from busybox sh.
#   . /usr/lib/memloop-vm/region.sh
#   region_peek32 OFFSET          prints the word at OFFSET as 0xXXXXXXXX
#   region_poke32 OFFSET VALUE    writes a 32-bit word
#   region_wait32 OFFSET VALUE [SECONDS]   waits (default 30 s) until the word equals VALUE
# The BAR's sysfs file (MEMLOOP_REGION) can only be mmap()ed: read()/write() on it (dd, cat) fail
# with EIO, so these go through /dev/mem at the BAR's physical address (busybox devmem).
# Offsets are bytes from the start of the region; words are little-endian as on the host.

: "${MEMLOOP_REGION_PHYS:?no ivshmem region in this guest}"

region_peek32() {
  devmem $((MEMLOOP_REGION_PHYS + $1)) 32
}

region_poke32() {
  devmem $((MEMLOOP_REGION_PHYS + $1)) 32 "$2"
}

region_wait32() {
  _rw_n=$((${3:-30} * 20))
  while [ "$_rw_n" -gt 0 ]; do
    [ $(($(region_peek32 "$1"))) -eq $(($2)) ] && return 0
    sleep 0.05
    _rw_n=$((_rw_n - 1))
  done
  echo "region_wait32: word at $1 is $(region_peek32 "$1"), not $2, after ${3:-30} s" >&2
  return 1
}
