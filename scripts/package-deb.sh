#!/usr/bin/env bash
# Builds the Debian package of the workspace: target/debian/memloop_VERSION_ARCH.deb, with
#   /usr/bin/memloop, /usr/bin/memloop-bench
#   /usr/lib/memloop/libmemloop.so              (found by `memloop run` from /usr/bin)
#   /usr/lib/memloop/libmemloop_preload.so      (the engine it loads when a process needs it)
#   /usr/share/man/man1/memloop*.1.gz           (generated from the command line's definition)
#   bash, zsh and fish completions              (likewise)
#   /lib/systemd/system/memloop-region.service  (the default region at boot, group memloop)
#   /lib/systemd/system/memloop-pipe.service    (the pipe service on the default region; not enabled by default)
#   /usr/share/containers/oci/hooks.d/memloop.json (containers opt in by an annotation)
#   /usr/lib/memloop/memloop-runc               (the same as an OCI runtime wrapper, for docker)
# and a postinst that creates the `memloop` group. Prints the package's path.
#   scripts/package-deb.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v dpkg-deb >/dev/null || { echo "package-deb: needs dpkg-deb" >&2; exit 1; }
cargo build --release -p memloop-cli -p memloop-preload -p memloop-bench >&2

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
arch=$(dpkg --print-architecture)
root=$(mktemp -d /tmp/memloop-deb.XXXXXX)
trap 'rm -rf "$root"' EXIT

install -D -m 755 target/release/memloop "$root/usr/bin/memloop"
install -D -m 755 target/release/memloop-bench "$root/usr/bin/memloop-bench"
install -D -m 644 target/release/libmemloop.so "$root/usr/lib/memloop/libmemloop.so"
install -D -m 644 target/release/libmemloop_preload.so "$root/usr/lib/memloop/libmemloop_preload.so"
# Debug information stays in the build tree: the package carries code only.
strip --strip-debug "$root/usr/bin/memloop" "$root/usr/bin/memloop-bench" \
  "$root/usr/lib/memloop/libmemloop.so" "$root/usr/lib/memloop/libmemloop_preload.so"

docs=$(mktemp -d "$root.docs.XXXXXX")
target/release/memloop generate-docs "$docs"
install -d "$root/usr/share/man/man1"
for page in "$docs"/man/*.1; do
  gzip -9n <"$page" >"$root/usr/share/man/man1/$(basename "$page").gz"
done
install -D -m 644 "$docs/completions/memloop" "$root/usr/share/bash-completion/completions/memloop"
install -D -m 644 "$docs/completions/_memloop" "$root/usr/share/zsh/vendor-completions/_memloop"
install -D -m 644 "$docs/completions/memloop.fish" "$root/usr/share/fish/vendor_completions.d/memloop.fish"
rm -rf "$docs"

install -D -m 644 packaging/memloop-region.service "$root/lib/systemd/system/memloop-region.service"
install -D -m 644 packaging/memloop-pipe.service "$root/lib/systemd/system/memloop-pipe.service"
# The OCI runtime wrapper for engines without precreate hooks (docker): memloop by that name.
ln -s /usr/bin/memloop "$root/usr/lib/memloop/memloop-runc"
# The hook description, for the installed binary.
target/release/memloop container install --hooks-dir "$root/usr/share/containers/oci/hooks.d" \
  --exe /usr/bin/memloop >/dev/null
install -D -m 644 README.md "$root/usr/share/doc/memloop/README.md"
install -D -m 644 docs/ARCHITECTURE.md "$root/usr/share/doc/memloop/ARCHITECTURE.md"

install -d "$root/DEBIAN"
install -m 755 packaging/debian/postinst packaging/debian/postrm "$root/DEBIAN/"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat >"$root/DEBIAN/control" <<EOF
Package: memloop
Version: $version
Architecture: $arch
Maintainer: memloop developers <memloop@localhost>
Installed-Size: $size
Depends: libc6, adduser
Recommends: iproute2
Suggests: podman
Section: net
Priority: optional
Description: shared-memory channels for co-resident processes, containers and VMs
 Unmodified programs that talk TCP to a peer on the same host get a shared-memory
 ring instead of the network stack (memloop run, or an annotation on a podman
 container); peers elsewhere keep the normal path.
EOF
mkdir -p target/debian
out=target/debian/memloop_${version}_${arch}.deb
dpkg-deb --build --root-owner-group "$root" "$out" >&2
echo "$out"
