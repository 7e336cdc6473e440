#!/usr/bin/env bash
# The Debian package, installed as a user would install it: scripts/package-deb.sh builds it,
# `dpkg -i` installs it, and from PATH alone
#   - `memloop run` finds the packaged library and a preloaded pair carries its bytes on a ring
#     (the region's counters say so);
#   - `man memloop` and `man memloop-run` show their pages; the completions, the systemd unit
#     and the OCI hook are where the engines and shells look for them; the unit is valid
#     (systemd-analyze, where there is one);
#   - `dpkg -r` then `dpkg --purge` take it all away again.
# Needs root and dpkg. Exit status 0 = passed.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "package: needs root (dpkg -i)" >&2; exit 1; }
fail() { echo "package: FAILED: $*" >&2; exit 1; }
ok() { echo "package: ok: $*"; }

dpkg -s memloop >/dev/null 2>&1 && fail "a memloop package is already installed: not touching it"
command -v man >/dev/null || { apt-get update -qq && apt-get install -y -qq man-db >/dev/null; }
deb=$(scripts/package-deb.sh)
region=pkg-test-$$
work=$(mktemp -d /tmp/memloop-package.XXXXXX)
cleanup() {
  /usr/bin/memloop region destroy --region "$region" >/dev/null 2>&1 || true
  dpkg --purge memloop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

dpkg -i "$deb" >/dev/null || fail "dpkg -i $deb"
getent group memloop >/dev/null || fail "postinst made no memloop group"
ok "installed $(basename "$deb") ($(dpkg-query -W -f '${Installed-Size}' memloop) KiB)"

# From PATH alone: a clean environment, the build tree nowhere on it.
clean=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)
cat >"$work/pair.py" <<'EOF'
import hashlib, socket, threading
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(1)
data = hashlib.sha256(b"x").digest() * 32768  # 1 MiB
def serve():
    c, _ = ls.accept()
    got = bytearray()
    while len(got) < len(data):
        got += c.recv(1 << 16)
    c.sendall(hashlib.sha256(got).digest())
threading.Thread(target=serve, daemon=True).start()
s = socket.create_connection(ls.getsockname())
s.sendall(data)
digest = b""
while len(digest) < 32:
    digest += s.recv(32)
assert digest == hashlib.sha256(data).digest()
print("OK")
EOF
out=$("${clean[@]}" memloop run --strict --region "$region" -- python3 "$work/pair.py" 2>&1) ||
  fail "memloop run from PATH: $out"
[ "$out" = OK ] || fail "the pair under the packaged library: $out"
ring=$("${clean[@]}" memloop status --json --region "$region" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ring_bytes"])')
[ "$ring" -ge 1048576 ] || fail "the packaged library moved $ring ring bytes (want ≥ 1 MiB)"
ok "memloop run from PATH: a preloaded pair moved $ring bytes through a ring"

for page in memloop memloop-run memloop-status memloop-container; do
  man -P cat "$page" 2>/dev/null | grep -q "^NAME" || fail "man $page shows no page"
done
man -P cat memloop-run 2>/dev/null | grep -q -- "--strict" || fail "man memloop-run lacks --strict"
ok "man pages: memloop, memloop-run, memloop-status, memloop-container"

for f in /usr/share/bash-completion/completions/memloop /usr/share/zsh/vendor-completions/_memloop \
  /usr/share/fish/vendor_completions.d/memloop.fish; do
  [ -s "$f" ] || fail "no completion file $f"
done
words=$(bash -c 'source /usr/share/bash-completion/completions/memloop
  COMP_WORDS=(memloop st); COMP_CWORD=1; COMP_LINE="memloop st"; COMP_POINT=10
  _memloop memloop st memloop; printf "%s\n" "${COMPREPLY[@]}"')
grep -qx status <<<"$words" || fail "bash completion of 'memloop st': $words"
ok "completions (bash completes 'memloop st' to status; zsh, fish files)"

for unit in /lib/systemd/system/memloop-region.service /lib/systemd/system/memloop-pipe.service; do
  [ -f "$unit" ] || fail "no systemd unit $unit"
  if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify "$unit" 2>"$work/verify.err" ||
      fail "systemd-analyze verify: $(cat "$work/verify.err")"
  fi
done
[ "$(readlink /usr/lib/memloop/memloop-runc)" = /usr/bin/memloop ] || fail "no runtime wrapper link"
hook=/usr/share/containers/oci/hooks.d/memloop.json
python3 -c 'import json,sys; h=json.load(open(sys.argv[1])); assert h["hook"]["path"] == "/usr/bin/memloop" and h["stages"] == ["precreate"], h' "$hook" ||
  fail "the OCI hook description: $(cat "$hook")"
ok "systemd units (region, pipe service) and OCI hook in place"

/usr/bin/memloop region destroy --region "$region" >/dev/null 2>&1 || true
dpkg -r memloop >/dev/null || fail "dpkg -r"
dpkg --purge memloop >/dev/null || fail "dpkg --purge"
[ ! -e /usr/bin/memloop ] && [ ! -e /usr/lib/memloop ] && [ ! -e "$hook" ] || fail "files left after dpkg -r"
! getent group memloop >/dev/null || fail "the memloop group survived the purge"
ok "removed and purged: nothing left"
