#!/usr/bin/env bash
# Runs one case of the suite in its own process (run.sh bounds it with timeout(1)):
#   case.sh NAME   (environment from run.sh)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/programs/lib.sh
. "$HERE/lib.sh"
for f in "$HERE"/cases/*.sh; do
  # shellcheck source=/dev/null
  . "$f"
done
trap storm_kill EXIT # a case that fails leaves no storm behind
fn=case_${1//-/_}
declare -F "$fn" >/dev/null || fail "no case $1 (function $fn)"
"$fn"
