#!/bin/sh
# shellcheck shell=sh
# /init of the memloop test guests (busybox sh, PID 1). Built into the initramfs by
# `scripts/vm/vm.sh image`; the per-run archive that `vm.sh run` appends adds /vm.env (name and
# addresses of this guest) and /job.sh (the command to run). Prints MEMLOOP-VM-* marker lines that
# the host side parses, then powers the machine off. Never returns (PID 1 exiting = panic).

PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH

mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/null >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/shm /dev/pts /tmp /run
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run
ln -sf /proc/self/fd /dev/fd 2>/dev/null

uptime_s() { cut -d' ' -f1 /proc/uptime; }

finish() {
  echo "MEMLOOP-VM-JOB-END uptime=$(uptime_s)"
  echo "MEMLOOP-VM-EXIT $1"
  sync
  poweroff -f
  echo o >/proc/sysrq-trigger
  sleep 5
}

MEMLOOP_VM_NAME=unknown
VM_IP="" VM_IP6="" VM_PREFIX=24 VM_GW=""
# shellcheck disable=SC1091
[ -f /vm.env ] && . /vm.env
export MEMLOOP_VM_NAME
hostname "$MEMLOOP_VM_NAME"

# Kernel modules, in dependency order (computed on the host when the image was built).
if [ -f /etc/memloop-vm/modules ]; then
  while read -r ko; do
    [ -n "$ko" ] || continue
    insmod "$ko" || echo "init: insmod $ko failed"
  done </etc/memloop-vm/modules
fi
# TUN devices (memloop link): devtmpfs makes the node when tun loads; make it if it did not.
if [ -d /sys/class/misc/tun ] && [ ! -c /dev/net/tun ]; then
  mkdir -p /dev/net
  mknod -m 666 /dev/net/tun c 10 200
fi

# Network: loopback, then the first virtio-net interface.
ip link set lo up
ifc=""
i=0
while [ $i -lt 50 ]; do
  for d in /sys/class/net/*; do
    n=${d##*/}
    [ "$n" = lo ] && continue
    ifc=$n
    break
  done
  [ -n "$ifc" ] && break
  sleep 0.1
  i=$((i + 1))
done
if [ -n "$ifc" ] && [ -n "$VM_IP" ]; then
  echo 0 >"/proc/sys/net/ipv6/conf/$ifc/accept_dad" 2>/dev/null
  ip addr add "$VM_IP/$VM_PREFIX" dev "$ifc"
  [ -n "$VM_IP6" ] && ip -6 addr add "$VM_IP6/64" dev "$ifc"
  ip link set "$ifc" up
  [ -n "$VM_GW" ] && ip route add default via "$VM_GW"
  # Wait for the carrier (up to 2 s), then announce the address: peers that already tried to
  # reach it (a FAILED neighbour entry) would otherwise drop their first replies to us.
  i=0
  while [ "$(cat "/sys/class/net/$ifc/carrier" 2>/dev/null)" != 1 ] && [ $i -lt 40 ]; do
    sleep 0.05
    i=$((i + 1))
  done
  arping -U -c 1 -I "$ifc" "$VM_IP" >/dev/null 2>&1 &
else
  echo "init: no network interface (or no address configured)"
fi
MEMLOOP_VM_IFACE=$ifc
export MEMLOOP_VM_IFACE

# The ivshmem device (PCI 1af4:1110): enable it, its BAR 2 is the shared region.
MEMLOOP_REGION=""
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/vendor" 2>/dev/null)" = 0x1af4 ] || continue
  [ "$(cat "$d/device" 2>/dev/null)" = 0x1110 ] || continue
  echo 1 >"$d/enable"
  MEMLOOP_REGION=$d/resource2
  # Physical address of BAR 2 (third line of `resource`), for /dev/mem access (region.sh).
  MEMLOOP_REGION_PHYS=$(sed -n 3p "$d/resource" | cut -d' ' -f1)
  MEMLOOP_REGION_SIZE=$(stat -c %s "$MEMLOOP_REGION")
  break
done
if [ -n "$MEMLOOP_REGION" ]; then
  export MEMLOOP_REGION MEMLOOP_REGION_PHYS MEMLOOP_REGION_SIZE
else
  echo "init: no ivshmem device (1af4:1110) found"
  unset MEMLOOP_REGION
fi

MEMLOOP_PRELOAD=/usr/lib/memloop/libmemloop.so
HOME=/root
export MEMLOOP_PRELOAD HOME
cd /root || cd /

echo
echo "MEMLOOP-VM-JOB-START uptime=$(uptime_s) name=$MEMLOOP_VM_NAME ip=$VM_IP region=${MEMLOOP_REGION:-none}"
if [ -f /job.sh ]; then
  sh /job.sh
  status=$?
else
  echo "init: no /job.sh"
  status=97
fi
finish "$status"
