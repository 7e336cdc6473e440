#!/usr/bin/env bash
# Two real QEMU guests that share one memory region (ivshmem) and are also joined by virtio-net.
#
#   scripts/vm/vm.sh image                 build (or reuse) the guest kernel + initramfs
#   scripts/vm/vm.sh run --region FILE [--a CMD] [--b CMD] [options]
#   scripts/vm/vm.sh cleanup               remove what an interrupted run left behind
#
# See scripts/vm/README.md. Needs root (apt-get, network namespace, taps).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BIN_DIR=${MEMLOOP_VM_BIN_DIR:-$TARGET/release}
VM_DIR=${MEMLOOP_VM_DIR:-$TARGET/vm}
NETNS=${MEMLOOP_VM_NETNS:-memloop-vm}
BRIDGE=mlvmbr0
HOST_IP=10.77.0.1
HOST_IP6=fd77::1
# Kernel modules the guests load (their dependencies are added); built-in ones are skipped.
# fuse + loop: `memloop blk attach`; nbd: the NBD baseline of tests/vm/memloop.sh run 7;
# crc32c_generic before ext4: ext4/jbd2 ask the crypto API for "crc32c" (metadata_csum), which
# the guests cannot modprobe on demand (a soft dependency, not in the .ko's depends=).
MODULES=${MEMLOOP_VM_MODULES:-virtio_pci virtio_net tun fuse loop nbd crc32c_generic ext4}
PACKAGES=(qemu-system-x86 busybox-static cpio socat sockperf iperf3 xz-utils iproute2 mount e2fsprogs nbd-server nbd-client)
# Dynamically linked host programs copied into the guests (with their libraries) as /usr/bin/NAME.
# (util-linux losetup: `memloop blk attach` runs `losetup --direct-io=on --find --show
# --sector-size N`, which busybox's losetup does not take; /usr/bin comes before busybox's
# /sbin/losetup in the guests' PATH.)
PROGRAMS=${MEMLOOP_VM_PROGRAMS:-socat sockperf iperf3 losetup mkfs.ext4 fsck.ext4 nbd-server nbd-client}

log() { printf '[vm] %s\n' "$*" >&2; }
die() {
  printf '[vm] error: %s\n' "$*" >&2
  exit 2
}

usage() {
  sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<'EOF'

run options:
  --region FILE      shared region: an existing file (in /dev/shm) whose size is a power of two
  --a CMD, --b CMD   shell command (busybox sh) run in guest a / b after boot; an omitted guest
                     is not booted
  --host CMD         bash command run on the host side, inside the network namespace that holds
                     the bridge (10.77.0.1), started before the guests; its status counts too
  --timeout SECONDS  bound for every QEMU and for the whole run (default 120)
  --kill-b-on STR    SIGKILL guest b's QEMU as soon as its console shows STR (counts as success)
  --log-dir DIR      where a.log, b.log (serial consoles) and host.log go (default: a temp dir)
  --add SRC:DEST     copy host file SRC to DEST in both guests (repeatable)
  --mem MB           guest memory (default 256)
  --append ARGS      more kernel command line (e.g. "loglevel=7" to undo "quiet")
  --quiet            do not stream the consoles; print them only if the run fails
EOF
}

# ---------------------------------------------------------------------------------------------
# image

ensure_packages() {
  local missing=() p st
  for p in "${PACKAGES[@]}"; do
    st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [ "$st" = "install ok installed" ] || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# Prints the name of the package linux-image-amd64 depends on (linux-image-6.1.0-NN-amd64).
kernel_package() {
  local k
  k=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
  if [ -z "$k" ]; then
    apt-get update -qq >/dev/null 2>&1 || true
    k=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
  fi
  printf '%s\n' "$k"
}

# Decompresses the kernel ELF out of a bzImage (the XZ stream inside it) for direct PVH boot.
extract_vmlinux() {
  local bz=$1 out=$2 off
  local offs
  offs=$(LC_ALL=C grep -obUaP '\xfd\x37\x7a\x58\x5a\x00' "$bz" | cut -d: -f1 || true)
  for off in $offs; do
    tail -c +$((off + 1)) "$bz" | xz -dc --single-stream >"$out" 2>/dev/null || true
    if [ "$(head -c 4 "$out" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
      return 0
    fi
  done
  offs=$(LC_ALL=C grep -obUaP '\x28\xb5\x2f\xfd' "$bz" | cut -d: -f1 || true)
  for off in $offs; do
    tail -c +$((off + 1)) "$bz" | zstd -dcq >"$out" 2>/dev/null || true
    if [ "$(head -c 4 "$out" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
      return 0
    fi
  done
  return 1
}

# Downloads the kernel package and keeps: vmlinux, config, the wanted modules (+ dependencies)
# and their load order.
fetch_kernel() {
  local pkg=$1 dir=$2 tmp deb kver m f
  tmp=$(mktemp -d "$VM_DIR/kernel-dl.XXXXXX")
  log "downloading $pkg"
  (cd "$tmp" && apt-get download "$pkg" >/dev/null 2>&1) ||
    (apt-get update -qq >/dev/null 2>&1 && cd "$tmp" && apt-get download "$pkg" >/dev/null) ||
    die "apt-get download $pkg failed"
  deb=$(ls "$tmp"/*.deb)
  mkdir -p "$tmp/x"
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp/x" --wildcards './boot/vmlinuz-*' './boot/config-*' \
    './lib/modules/*/modules.builtin'
  kver=$(basename "$(ls -d "$tmp"/x/lib/modules/*)")
  mkdir -p "$tmp/out/modules"
  extract_vmlinux "$tmp/x/boot/vmlinuz-$kver" "$tmp/out/vmlinux" || die "no kernel ELF found in vmlinuz-$kver"
  cp "$tmp/x/boot/config-$kver" "$tmp/out/config"
  echo "$kver" >"$tmp/out/kver"

  # Module name -> path in the package (module names use _ where file names may use -).
  declare -A path=()
  local p name
  while read -r p; do
    name=$(basename "$p")
    name=${name%%.ko*}
    path[${name//-/_}]=$p
  done < <(dpkg-deb -c "$deb" | awk '{ print $NF }' | grep -E '\.ko(\.xz|\.zst|\.gz)?$')

  declare -A seen=()
  local order=()
  visit() {
    local n=$1 p f dep deps
    [ -n "${seen[$n]:-}" ] && return 0
    seen[$n]=1
    p=${path[$n]:-}
    if [ -z "$p" ]; then
      if grep -qE "/${n//_/[-_]}\.ko$" "$tmp/x/lib/modules/$kver/modules.builtin"; then
        return 0 # built into the kernel
      fi
      die "kernel module $n is neither in $pkg nor built in"
    fi
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp/x" "$p"
    f=$tmp/out/modules/$n.ko
    case $p in
      *.ko.xz) xz -dc "$tmp/x/$p" >"$f" ;;
      *.ko.zst) zstd -dcq "$tmp/x/$p" >"$f" ;;
      *.ko.gz) gzip -dc "$tmp/x/$p" >"$f" ;;
      *) cp "$tmp/x/$p" "$f" ;;
    esac
    deps=$(tr '\0' '\n' <"$f" | sed -n 's/^depends=//p' | head -1)
    for dep in ${deps//,/ }; do visit "${dep//-/_}"; done
    order+=("$n")
  }
  for m in $MODULES; do visit "$m"; done
  printf '%s\n' "${order[@]}" >"$tmp/out/modules.order"
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  mv "$tmp/out" "$dir"
  rm -rf "$tmp"
  log "kernel $kver: vmlinux $(du -h "$dir/vmlinux" | cut -f1), modules: ${order[*]}"
}

# Every library (and the loader) that ldd reports for the given ELF files.
libs_of() {
  ldd "$@" 2>/dev/null | awk '
    !/^\t/ { next }
    /=> \// { print $3; next }
    /^\t\// { print $1 }' | sort -u
}

# Paths of the PROGRAMS.
program_paths() {
  local p
  for p in $PROGRAMS; do
    command -v "$p" || die "program $p (MEMLOOP_VM_PROGRAMS) is not installed"
  done
}

image_inputs() {
  # Everything whose change must rebuild the initramfs, as "path size mtime" lines.
  local progs libs
  mapfile -t progs < <(program_paths)
  local files=("$BIN_DIR/memloop" "$BIN_DIR/memloop-bench" "$BIN_DIR/libmemloop.so" "$BIN_DIR/libmemloop_preload.so" "$SCRIPT_DIR/init.sh" "$SCRIPT_DIR/region.sh"
    "${BASH_SOURCE[0]}" /bin/busybox "${progs[@]}")
  mapfile -t libs < <(libs_of "$BIN_DIR/memloop" "$BIN_DIR/memloop-bench" "$BIN_DIR/libmemloop_preload.so" "${progs[@]}")
  stat -L -c '%n %s %Y' "${files[@]}" "${libs[@]}"
  echo "modules: $MODULES"
  echo "programs: $PROGRAMS"
  echo "kernel: $(cat "$VM_DIR/kernel/current/kver")"
}

cmd_image() {
  [ "$(id -u)" = 0 ] || die "needs root"
  mkdir -p "$VM_DIR"
  exec 8>"$VM_DIR/image.lock"
  flock -w 600 8 || die "another image build holds $VM_DIR/image.lock"
  build_image
  exec 8>&-
}

build_image() {
  if [ ! -x "$BIN_DIR/memloop" ] || [ ! -x "$BIN_DIR/memloop-bench" ] || [ ! -f "$BIN_DIR/libmemloop.so" ] || [ ! -f "$BIN_DIR/libmemloop_preload.so" ]; then
    die "missing $BIN_DIR/memloop, memloop-bench, libmemloop.so or libmemloop_preload.so: cargo build --release -p memloop-cli -p memloop-bench -p memloop-preload"
  fi
  ensure_packages

  local kpkg="" kdir cur=$VM_DIR/kernel/current/package
  # Resolving linux-image-amd64 costs ~0.8 s: only when the apt lists changed since the last time.
  if [ ! -f "$cur" ] || [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -newer "$cur" 2>/dev/null | head -1)" ]; then
    kpkg=$(kernel_package)
  else
    kpkg=$(cat "$cur")
  fi
  if [ -z "$kpkg" ]; then
    [ -f "$VM_DIR/kernel/current/vmlinux" ] || die "cannot resolve linux-image-amd64 (apt-get update?)"
    kpkg=$(cat "$VM_DIR/kernel/current/package")
    log "apt-cache cannot resolve linux-image-amd64; using the cached $kpkg"
  fi
  kdir=$VM_DIR/kernel/$kpkg
  if [ ! -f "$kdir/vmlinux" ] || [ "$(cat "$kdir/modules.wanted" 2>/dev/null)" != "$MODULES" ]; then
    fetch_kernel "$kpkg" "$kdir"
    echo "$MODULES" >"$kdir/modules.wanted"
  fi
  echo "$kpkg" >"$kdir/package"
  ln -sfn "$kpkg" "$VM_DIR/kernel/current"
  local k
  for k in "$VM_DIR"/kernel/linux-image-*; do
    [ "$k" = "$kdir" ] || rm -rf "$k" # superseded kernels
  done

  rm -rf "$VM_DIR"/image.?????? "$VM_DIR"/kernel-dl.?????? # left by an interrupted build
  local stamp
  stamp=$(image_inputs | sha256sum | cut -d' ' -f1)
  if [ -f "$VM_DIR/initramfs.cpio" ] && [ "$(cat "$VM_DIR/image.stamp" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi

  log "building the initramfs"
  local st tmp a kver n
  tmp=$(mktemp -d "$VM_DIR/image.XXXXXX")
  st=$tmp/root
  kver=$(cat "$kdir/kver")
  mkdir -p "$st"/{bin,sbin,usr/bin,usr/sbin,usr/lib/memloop,lib/x86_64-linux-gnu,lib64,proc,sys,dev,tmp,run,root,mnt,etc/memloop-vm}
  mkdir -p "$st/lib/modules/$kver"
  cp /bin/busybox "$st/bin/busybox"
  for a in $(/bin/busybox --list-full); do
    [ -e "$st/$a" ] || [ -L "$st/$a" ] || ln -s /bin/busybox "$st/$a"
  done
  install -m 755 "$SCRIPT_DIR/init.sh" "$st/init"
  install -D -m 644 "$SCRIPT_DIR/region.sh" "$st/usr/lib/memloop-vm/region.sh"
  # Debug info stripped (symbols kept): 28 MB -> 4 MB for the CLI.
  strip --strip-debug -o "$st/usr/bin/memloop" "$BIN_DIR/memloop" 2>/dev/null ||
    cp "$BIN_DIR/memloop" "$st/usr/bin/memloop"
  # `memloop bench …` runs the memloop-bench next to it.
  strip --strip-debug -o "$st/usr/bin/memloop-bench" "$BIN_DIR/memloop-bench" 2>/dev/null ||
    cp "$BIN_DIR/memloop-bench" "$st/usr/bin/memloop-bench"
  # The preload library and the engine it loads (`memloop run` finds the first, which finds
  # the second beside it).
  for so in libmemloop.so libmemloop_preload.so; do
    strip --strip-debug -o "$st/usr/lib/memloop/$so" "$BIN_DIR/$so" 2>/dev/null ||
      cp "$BIN_DIR/$so" "$st/usr/lib/memloop/$so"
  done
  local progs lib
  mapfile -t progs < <(program_paths)
  # (A busybox applet link of the same name would make cp write through it into busybox.)
  for a in "${progs[@]}"; do rm -f "$st/usr/bin/${a##*/}"; done
  cp "${progs[@]}" "$st/usr/bin/"
  while read -r lib; do
    mkdir -p "$st$(dirname "$lib")"
    cp -L "$lib" "$st$lib"
  done < <(libs_of "$BIN_DIR/memloop" "$BIN_DIR/memloop-bench" "$BIN_DIR/libmemloop_preload.so" "${progs[@]}")
  [ -e "$st/lib64/ld-linux-x86-64.so.2" ] || die "the dynamic loader was not found by ldd"

  : >"$st/etc/memloop-vm/modules"
  while read -r n; do
    cp "$kdir/modules/$n.ko" "$st/lib/modules/$kver/$n.ko"
    echo "/lib/modules/$kver/$n.ko" >>"$st/etc/memloop-vm/modules"
  done <"$kdir/modules.order"

  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$st/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$st/etc/group"
  printf '127.0.0.1 localhost\n::1 localhost\n%s host\n10.77.0.2 a\n10.77.0.3 b\n%s host\nfd77::2 a\nfd77::3 b\n' \
    "$HOST_IP" "$HOST_IP6" >"$st/etc/hosts"
  printf 'passwd: files\ngroup: files\nhosts: files\n' >"$st/etc/nsswitch.conf"
  : >"$st/etc/resolv.conf"
  mknod -m 600 "$st/dev/console" c 5 1
  mknod -m 666 "$st/dev/null" c 1 3

  # Uncompressed: unpacking 10 MB of gzip costs the emulated guest ~0.4 s more than copying 26 MB.
  (cd "$st" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$tmp/initramfs.cpio"
  mv "$tmp/initramfs.cpio" "$VM_DIR/initramfs.cpio"
  echo "$stamp" >"$VM_DIR/image.stamp"
  log "initramfs $(du -h "$VM_DIR/initramfs.cpio" | cut -f1) ($(du -sh "$st" | cut -f1) unpacked), kernel $kver"
  rm -rf "$tmp"
}

# ---------------------------------------------------------------------------------------------
# network (a network namespace of our own holds the bridge, the taps and the QEMUs)

net_down() {
  local p
  if ip netns list 2>/dev/null | awk '{ print $1 }' | grep -qxF "$NETNS"; then
    for p in $(ip netns pids "$NETNS" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    ip netns del "$NETNS" 2>/dev/null || true
  fi
}

net_up() {
  local g
  ip netns add "$NETNS"
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" link add "$BRIDGE" type bridge forward_delay 0 stp_state 0
  ip -n "$NETNS" link set "$BRIDGE" type bridge nf_call_iptables 0 nf_call_ip6tables 0 nf_call_arptables 0 2>/dev/null || true
  ip netns exec "$NETNS" sh -c "echo 0 > /proc/sys/net/ipv6/conf/$BRIDGE/accept_dad" 2>/dev/null || true
  ip -n "$NETNS" addr add "$HOST_IP/24" dev "$BRIDGE"
  ip -n "$NETNS" -6 addr add "$HOST_IP6/64" dev "$BRIDGE" nodad 2>/dev/null || true
  ip -n "$NETNS" link set "$BRIDGE" up
  for g in a b; do
    ip -n "$NETNS" tuntap add dev "mlvm-$g" mode tap
    ip -n "$NETNS" link set "mlvm-$g" master "$BRIDGE" up
  done
}

# ---------------------------------------------------------------------------------------------
# run

STATE_DIR=""
declare -A PID=() QPIDFILE=()
TAIL_PIDS=()
HOST_PID=""

kill_guests() {
  local g q
  for g in "${!PID[@]}"; do
    q=$(cat "${QPIDFILE[$g]}" 2>/dev/null || true)
    if [ -n "$q" ]; then kill -KILL "$q" 2>/dev/null || true; fi
    kill -TERM "${PID[$g]}" 2>/dev/null || true
  done
}

# shellcheck disable=SC2317 # (runs from the EXIT trap)
run_cleanup() {
  local p rc=$?
  set +e
  trap - EXIT INT TERM HUP
  kill_guests
  [ -n "$HOST_PID" ] && kill -TERM "$HOST_PID" 2>/dev/null
  net_down
  rm -f "$VM_DIR"/run/*.qpid
  for p in "${TAIL_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -n "$STATE_DIR" ] && rm -rf "$STATE_DIR"
  wait 2>/dev/null
  exit "$rc"
}

# Kills the QEMUs and removes the namespace that a run killed with SIGKILL left behind.
cmd_cleanup() {
  local f q
  for f in "$VM_DIR"/run/*.qpid; do
    [ -f "$f" ] || continue
    q=$(cat "$f")
    if [ -n "$q" ] && grep -q qemu "/proc/$q/cmdline" 2>/dev/null; then
      log "killing leftover QEMU $q"
      kill -KILL "$q" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  rm -rf "$VM_DIR/run/state"
  net_down
}

# alive PID: running and not a zombie
alive() {
  local st
  [ -r "/proc/$1/stat" ] || return 1
  st=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) || return 1
  [ "$st" != Z ]
}

# Console lines as printed: no CR, no terminal escapes (SeaBIOS clears the screen).
CLEAN='s/\r$//; s/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g'

now() { printf '%s' "$EPOCHREALTIME"; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

stream() { # LOG PREFIX PID
  tail -n +1 -s 0.2 --pid="$3" -F "$1" 2>/dev/null 9>&- | sed -u -e "$CLEAN" -e "s/^/$2 /" 9>&- &
  TAIL_PIDS+=($!)
}

cmd_run() {
  local region="" append="console=ttyS0 panic=-1 quiet rodata=off" timeout=120 kill_on="" log_dir="" mem=256 quiet=0 host_cmd=""
  declare -A job=()
  local adds=()
  while [ $# -gt 0 ]; do
    case $1 in
      --quiet | --help | -h | --) ;;
      *) [ $# -ge 2 ] || die "$1 needs a value" ;;
    esac
    case $1 in
      --region) region=$2; shift 2 ;;
      --a) job[a]=$2; shift 2 ;;
      --b) job[b]=$2; shift 2 ;;
      --host) host_cmd=$2; shift 2 ;;
      --timeout) timeout=$2; shift 2 ;;
      --kill-b-on) kill_on=$2; shift 2 ;;
      --log-dir) log_dir=$2; shift 2 ;;
      --add) adds+=("$2"); shift 2 ;;
      --mem) mem=$2; shift 2 ;;
      --append) append="$append $2"; shift 2 ;;
      --quiet) quiet=1; shift ;;
      --) shift; [ $# -eq 0 ] || die "unexpected arguments after --: $*" ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown option $1 (see --help)" ;;
    esac
  done
  [ "$(id -u)" = 0 ] || die "needs root"
  [ -n "$region" ] || die "--region FILE is required"
  [ -f "$region" ] || die "region $region does not exist (create and size it first)"
  local size
  size=$(stat -L -c %s "$region")
  if [ "$size" -le 0 ] || [ $((size & (size - 1))) -ne 0 ]; then
    die "region size $size is not a power of two"
  fi
  [ ${#job[@]} -gt 0 ] || die "nothing to run: give --a and/or --b"
  [ -z "$kill_on" ] || [ -n "${job[b]:-}" ] || die "--kill-b-on needs guest b"
  [[ $timeout =~ ^[0-9]+$ ]] || die "--timeout takes whole seconds"

  cmd_image
  exec 9>"$VM_DIR/run.lock"
  flock -w "$timeout" 9 || die "another run holds $VM_DIR/run.lock"
  mkdir -p "$VM_DIR/run"
  cmd_cleanup # a previous run killed with SIGKILL may have left QEMUs or the namespace behind

  local tmp_logs=0
  if [ -z "$log_dir" ]; then
    log_dir=$(mktemp -d /tmp/memloop-vm.XXXXXX)
    tmp_logs=1
  fi
  mkdir -p "$log_dir"
  log_dir=$(cd "$log_dir" && pwd)
  # Per-run files (initrds, QEMU stderr); runs hold the lock, so one at a time.
  STATE_DIR=$VM_DIR/run/state
  mkdir -p "$STATE_DIR"
  trap run_cleanup EXIT
  trap 'log "interrupted"; exit 130' INT TERM HUP

  net_up

  # Per-guest initrd: the base initramfs + a small archive with /vm.env and /job.sh.
  local g ip ip6 spec src dest
  for g in a b; do
    [ -n "${job[$g]:-}" ] || continue
    case $g in a) ip=10.77.0.2 ip6=fd77::2 ;; b) ip=10.77.0.3 ip6=fd77::3 ;; esac
    local r=$STATE_DIR/extra-$g
    mkdir -p "$r"
    printf 'MEMLOOP_VM_NAME=%s\nVM_IP=%s\nVM_IP6=%s\nVM_PREFIX=24\nVM_GW=%s\n' "$g" "$ip" "$ip6" "$HOST_IP" >"$r/vm.env"
    printf '%s\n' "${job[$g]}" >"$r/job.sh"
    chmod 755 "$r/job.sh"
    for spec in "${adds[@]}"; do
      src=${spec%%:*} dest=${spec#*:}
      if [ "$src" = "$spec" ] || [ "${dest:0:1}" != / ]; then die "--add takes SRC:/DEST"; fi
      [ -e "$src" ] || die "--add: $src does not exist"
      mkdir -p "$r$(dirname "$dest")"
      cp -a "$src" "$r$dest"
    done
    (cd "$r" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) | gzip -1 >"$STATE_DIR/extra-$g.cpio.gz"
    # Concatenated archives form one initramfs (a compressed one may start at any offset).
    cat "$VM_DIR/initramfs.cpio" "$STATE_DIR/extra-$g.cpio.gz" >"$STATE_DIR/initrd-$g"
    : >"$log_dir/$g.log"
  done

  local t0 deadline
  t0=$(now)
  if [ -n "$host_cmd" ]; then
    : >"$log_dir/host.log"
    MEMLOOP_REGION=$region MEMLOOP_VM_NETNS=$NETNS MEMLOOP_VM_LOG_DIR=$log_dir \
      MEMLOOP_VM_HOST=$HOST_IP MEMLOOP_VM_A=10.77.0.2 MEMLOOP_VM_B=10.77.0.3 \
      ip netns exec "$NETNS" bash -c "$host_cmd" </dev/null >"$log_dir/host.log" 2>&1 9>&- &
    HOST_PID=$!
    [ $quiet = 1 ] || stream "$log_dir/host.log" "[host]" "$HOST_PID"
  fi

  declare -A start=() end=() rc=()
  local first=1
  for g in a b; do
    [ -n "${job[$g]:-}" ] || continue
    [ $first = 1 ] || sleep 0.3 # b starts a little after a
    first=0
    QPIDFILE[$g]=$VM_DIR/run/$g.qpid
    rm -f "${QPIDFILE[$g]}"
    start[$g]=$(now)
    local mac=52:54:00:77:00:02
    [ $g = a ] || mac=52:54:00:77:00:03
    # shellcheck disable=SC2054 # (commas inside QEMU option values)
    local qemu=(ip netns exec "$NETNS" timeout --kill-after=5 "$timeout"
      qemu-system-x86_64 -name "memloop-$g" -accel tcg,thread=multi -cpu max -m "$mem" -smp 1 -M q35
      -nographic -nodefaults -no-reboot -pidfile "${QPIDFILE[$g]}"
      -serial "file:$log_dir/$g.log"
      -kernel "$VM_DIR/kernel/current/vmlinux" -initrd "$STATE_DIR/initrd-$g" -append "$append"
      -object "memory-backend-file,id=hostmem,size=$size,share=on,mem-path=$region"
      -device ivshmem-plain,memdev=hostmem
      -netdev "tap,id=n0,ifname=mlvm-$g,script=no,downscript=no"
      -device "virtio-net-pci,netdev=n0,romfile=,mac=$mac")
    # In a subshell that exits normally, so a b killed on purpose draws no "Killed" job notice.
    (
      "${qemu[@]}" </dev/null >"$STATE_DIR/qemu-$g.err" 2>&1
      exit $?
    ) 2>/dev/null 9>&- & # (fd 9 holds the run lock: a QEMU outliving a killed vm.sh must not keep it)
    PID[$g]=$!
    [ $quiet = 1 ] || stream "$log_dir/$g.log" "[$g]" "${PID[$g]}"
  done

  # Wait for the guests (and the host command); kill b on request; bound everything.
  deadline=$(awk -v a="$t0" -v t="$timeout" 'BEGIN { printf "%d", a + t + 10 }')
  local killed_b=0 running q
  while :; do
    running=0
    for g in "${!PID[@]}"; do
      [ -z "${rc[$g]:-}" ] || continue
      if alive "${PID[$g]}"; then
        running=1
      else
        end[$g]=$(now)
        rc[$g]=0
        wait "${PID[$g]}" || rc[$g]=$?
      fi
    done
    if [ -n "$kill_on" ] && [ $killed_b = 0 ] && [ -z "${rc[b]:-}" ] && grep -qF -- "$kill_on" "$log_dir/b.log"; then
      q=$(cat "${QPIDFILE[b]}" 2>/dev/null || true)
      if [ -n "$q" ]; then
        kill -KILL "$q" 2>/dev/null || true
        killed_b=1
        log "b: console showed \"$kill_on\": SIGKILLed its QEMU (pid $q) at $(secs "$t0" "$(now)") s"
      fi
    fi
    if [ $running = 0 ]; then
      [ -z "$HOST_PID" ] || ! alive "$HOST_PID" && break
    fi
    if [ "${EPOCHREALTIME%.*}" -ge "$deadline" ]; then
      log "run exceeded its bound of $timeout s: killing everything"
      kill_guests
      [ -z "$HOST_PID" ] || kill -TERM "$HOST_PID" 2>/dev/null || true
      sleep 1
    fi
    sleep 0.05
  done
  local host_rc=0
  if [ -n "$HOST_PID" ]; then
    wait "$HOST_PID" || host_rc=$?
  fi
  local p
  for p in "${TAIL_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  TAIL_PIDS=()
  local t_end
  t_end=$(now)

  # Verdict.
  local fail=0 line st ts te msg
  for g in a b; do
    [ -n "${job[$g]:-}" ] || continue
    local l=$log_dir/$g.log
    line=$(tr -d '\r' <"$l" | grep -aoE 'MEMLOOP-VM-EXIT [0-9]+$' | tail -1 || true)
    st=${line#MEMLOOP-VM-EXIT }
    ts=$(tr -d '\r' <"$l" | sed -n 's/.*MEMLOOP-VM-JOB-START uptime=\([0-9.]*\).*/\1/p' | head -1)
    te=$(tr -d '\r' <"$l" | sed -n 's/.*MEMLOOP-VM-JOB-END uptime=\([0-9.]*\).*/\1/p' | tail -1)
    msg="$g: boot-to-job ${ts:-?} s, job $([ -n "$ts" ] && [ -n "$te" ] && secs "$ts" "$te" || echo ?) s (guest clock), wall $(secs "${start[$g]}" "${end[$g]}") s"
    if [ $g = b ] && [ $killed_b = 1 ]; then
      log "$msg: killed on purpose"
      continue
    fi
    if [ -n "$line" ] && [ "$st" = 0 ]; then
      log "$msg: ok"
      continue
    fi
    fail=1
    if [ "${rc[$g]}" = 124 ] || [ "${rc[$g]}" = 137 ]; then
      log "$msg: FAILED: timed out after $timeout s (QEMU killed)"
    elif grep -qa 'Kernel panic' "$l"; then
      log "$msg: FAILED: guest kernel panic: $(grep -a 'Kernel panic' "$l" | head -1 | tr -d '\r')"
    elif [ -n "$line" ]; then
      log "$msg: FAILED: job exited with status $st"
    else
      log "$msg: FAILED: no MEMLOOP-VM-EXIT line (QEMU status ${rc[$g]})"
    fi
    if [ -s "$STATE_DIR/qemu-$g.err" ]; then
      sed "s/^/[vm] $g qemu: /" "$STATE_DIR/qemu-$g.err" >&2
    fi
  done
  if [ -n "$kill_on" ] && [ $killed_b = 0 ]; then
    log "FAILED: \"$kill_on\" never appeared on b's console"
    fail=1
  fi
  if [ -n "$HOST_PID" ]; then
    if [ "$host_rc" = 0 ]; then log "host command: ok"; else
      log "host command: FAILED with status $host_rc"
      fail=1
    fi
  fi
  if [ $quiet = 1 ] && [ $fail = 1 ]; then
    for g in host a b; do
      [ -f "$log_dir/$g.log" ] && sed -e "$CLEAN" -e "s/^/[$g] /" "$log_dir/$g.log"
    done
  fi
  if [ $fail = 1 ]; then
    log "total $(secs "$t0" "$t_end") s; run FAILED; logs in $log_dir"
    return 1
  fi
  if [ $tmp_logs = 1 ]; then
    rm -rf "$log_dir"
    log "total $(secs "$t0" "$t_end") s; ok"
  else
    log "total $(secs "$t0" "$t_end") s; ok; logs in $log_dir"
  fi
  return 0
}

main() {
  case ${1:-} in
    image) shift; cmd_image "$@" ;;
    run) shift; cmd_run "$@" ;;
    cleanup)
      [ "$(id -u)" = 0 ] || die "needs root"
      mkdir -p "$VM_DIR"
      exec 9>"$VM_DIR/run.lock"
      flock -n 9 || die "a run is in progress (it holds $VM_DIR/run.lock)"
      cmd_cleanup
      ;;
    -h | --help | help | "") usage ;;
    *) die "unknown command $1 (image, run, cleanup)" ;;
  esac
}

# One line, read whole before it runs: editing this file during a run cannot derail the run.
main "$@"; exit $?
