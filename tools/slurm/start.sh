#!/usr/bin/env bash
# Start a one-node SLURM on this machine (munged, slurmctld, slurmd), as root, with tools/slurm/slurm.conf; install
# Debian's slurm-wlm and munge first where they are absent. Tested on Debian 12 (SLURM 22.05.8). It returns once
# `sinfo` shows the node idle. Then: python tools/sweep.py --cluster slurm --gpus-per-job 0 ..., and the SLURM tests
# (python -m pytest -q tests/test_slurm.py) run instead of skipping. Stop it with tools/slurm/stop.sh.
# Its state, spool, pid files and logs are its own (/var/spool/ppg-slurm, /run/ppg-slurm, /var/log/ppg-slurm): the
# state another SLURM left in SLURM's default places (its cluster's name, its jobs) neither stops it nor is touched.
# A daemon that does not start ends it with the last lines of the daemon's log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
logs=/var/log/ppg-slurm
if [ "$(id -u)" != 0 ]; then echo "error: tools/slurm/start.sh starts system daemons: run it as root" >&2; exit 1; fi

fail() {  # $1: what did not start, $2: its log
    echo "error: $1 did not start; the last lines of $2:" >&2
    tail -n 15 "$2" >&2 2>/dev/null || echo "(no log at $2)" >&2
    exit 1
}
alive() {  # whether the process of the pid file $1 runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

if alive /run/ppg-slurm/slurmctld.pid && sinfo --noheader --states=idle,mixed,allocated 2>/dev/null | grep -q .; then
    echo "slurm: already up"
    exit 0
fi
# Another SLURM's daemons would hold the ports this one needs: say so rather than start beside them
for daemon in slurmctld slurmd; do
    for pid in $(pidof "$daemon" || true); do
        if ! alive "/run/ppg-slurm/$daemon.pid" || [ "$(cat "/run/ppg-slurm/$daemon.pid")" != "$pid" ]; then
            echo "error: another $daemon runs here (pid $pid, not started by tools/slurm/start.sh): stop it first" >&2
            exit 1
        fi
    done
done
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
    runuser -u munge -- munged || fail munged /var/log/munge/munged.log
fi
mkdir -p /etc/slurm /var/spool/ppg-slurm/slurmctld /var/spool/ppg-slurm/slurmd /run/ppg-slurm "$logs"
# SLURM's commands read /etc/slurm/slurm.conf: another cluster's is kept beside it, not lost
if [ -f /etc/slurm/slurm.conf ] && ! grep -q '^ClusterName=ppg$' /etc/slurm/slurm.conf; then
    mv /etc/slurm/slurm.conf /etc/slurm/slurm.conf.before-ppg
    echo "slurm: another cluster's /etc/slurm/slurm.conf is now /etc/slurm/slurm.conf.before-ppg"
fi
sed -e "s/@HOST@/$(hostname -s)/g" -e "s/@CPUS@/$(nproc)/g" "$here/slurm.conf" >/etc/slurm/slurm.conf
# Each daemonises, where it is not running already; slurmd logs PMIx errors at start, harmless here (no MPI)
alive /run/ppg-slurm/slurmctld.pid || slurmctld || fail slurmctld "$logs/slurmctld.log"
alive /run/ppg-slurm/slurmd.pid || slurmd || fail slurmd "$logs/slurmd.log"
for _ in $(seq 60); do  # the node registers within seconds; a daemon that stops meanwhile says why in its log
    if sinfo --noheader --states=idle 2>/dev/null | grep -q .; then sinfo; exit 0; fi
    sleep 1
    alive /run/ppg-slurm/slurmctld.pid || fail slurmctld "$logs/slurmctld.log"
    alive /run/ppg-slurm/slurmd.pid || fail slurmd "$logs/slurmd.log"
done
sinfo >&2 || true
fail "the node (idle in 60 s)" "$logs/slurmctld.log"
