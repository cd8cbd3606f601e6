#!/usr/bin/env bash
# Run a command inside a cgroup with a CPU quota, as `docker run --cpus CPUS` would: a new
# group (v2 at the hierarchy's root, else v1's cpu and cpuacct hierarchies) limited to
# CPUS CPUs' worth of time in each 100 ms, removed after. Needs root. Prints the group's
# throttling counters at the end.
#
#   sudo bash benchmarks/cpu_quota.sh 1.5 .venv/bin/bevy bench --policies bevy,sync \
#       --workload chat --requests 8 --cache 0.3
set -euo pipefail
cpus=${1:?usage: cpu_quota.sh CPUS COMMAND...}
shift
quota=$(awk -v c="$cpus" 'BEGIN { printf "%d", c * 100000 }')
name=bevy-quota-$$
root=/sys/fs/cgroup
if [[ -f $root/cgroup.controllers ]]; then
    groups=("$root/$name")
    mkdir "${groups[0]}"
    echo "$quota 100000" >"${groups[0]}/cpu.max"
    stat=${groups[0]}/cpu.stat
else
    groups=("$root/cpu/$name" "$root/cpuacct/$name")
    mkdir "${groups[@]}"
    echo 100000 >"${groups[0]}/cpu.cfs_period_us"
    echo "$quota" >"${groups[0]}/cpu.cfs_quota_us"
    stat=${groups[0]}/cpu.stat
fi
trap 'rmdir "${groups[@]}" 2>/dev/null || true' EXIT
rc=0
# The child shell moves itself into the group(s), then becomes the command.
sh -c 'for g in "$@"; do [ "$g" = -- ] && break; echo $$ >"$g/cgroup.procs"; shift; done; shift; exec "$@"' \
    sh "${groups[@]}" -- "$@" || rc=$?
grep -E "nr_periods|nr_throttled|throttled_(time|usec)" "$stat" || true
exit $rc
