# Sourced by tests/containers/run.sh and scripts/bench-containers.sh: podman as this machine
# runs it, around a work directory WORK, a region R and containers named TAG-*.
#   podman_bed WORK R TAG   writes WORK/containers.conf (runc, cgroupfs, no default ulimits:
#                           what the machine notes say podman needs here) and exports it,
#                           creates region R, installs the OCI hook in WORK/hooks, and on exit
#                           removes the containers TAG-*, the region and WORK.
#   quiet                   filters podman's harmless "Peer netns" warning out of stderr.
# Needs M (the memloop binary).

podman_bed() {
  BED_WORK=$1 BED_REGION=$2 BED_TAG=$3
  trap podman_bed_down EXIT
  printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' \
    >"$BED_WORK/containers.conf"
  export CONTAINERS_CONF=$BED_WORK/containers.conf
  "$M" region create --region "$BED_REGION" >/dev/null
  "$M" container install --hooks-dir "$BED_WORK/hooks" >/dev/null
}

podman_bed_down() {
  local ids
  ids=$(podman ps -aq --filter "name=^$BED_TAG-" 2>/dev/null || true)
  [ -z "$ids" ] || podman rm -f -t 0 $ids >/dev/null 2>&1 || true
  "$M" region destroy --region "$BED_REGION" >/dev/null 2>&1 || true
  rm -rf "$BED_WORK"
}

quiet() { grep -v "Peer netns reference is invalid" || true; }
