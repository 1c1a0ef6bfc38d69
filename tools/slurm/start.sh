#!/usr/bin/env bash
# Start a one-node SLURM on this machine (munged, slurmctld, slurmd), as root, with tools/slurm/slurm.conf; install
# Debian's slurm-wlm and munge first where they are absent. Tested on Debian 12 (SLURM 22.05.8). It returns once
# `sinfo` shows the node idle. Then: python tools/sweep.py --cluster slurm --gpus-per-job 0 ..., and the SLURM tests
# (python -m pytest -q tests/test_slurm.py) run instead of skipping. Stop it with tools/slurm/stop.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "$(id -u)" != 0 ]; then echo "error: tools/slurm/start.sh starts system daemons: run it as root" >&2; exit 1; fi
if sinfo --noheader --states=idle,mixed,allocated 2>/dev/null | grep -q .; then echo "slurm: already up"; exit 0; fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    # (a mirror that does not answer ends the start in 10 minutes, not never)
    timeout 600 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq slurm-wlm munge >/dev/null
fi
# munge authenticates SLURM's messages: a key of 1024 random bytes that only the munge user reads
if [ ! -s /etc/munge/munge.key ]; then
    head -c 1024 /dev/urandom >/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- munged
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
sed -e "s/@HOST@/$(hostname -s)/g" -e "s/@CPUS@/$(nproc)/g" "$here/slurm.conf" >/etc/slurm/slurm.conf
# Each daemonises, where it is not running already; slurmd logs PMIx errors at start, harmless here (no MPI)
pidof slurmctld >/dev/null || slurmctld
pidof slurmd >/dev/null || slurmd
for _ in $(seq 60); do  # the node registers within seconds
    if sinfo --noheader --states=idle 2>/dev/null | grep -q .; then sinfo; exit 0; fi
    sleep 1
done
echo "error: the node did not come up idle in 60 s; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
sinfo >&2 || true
exit 1
