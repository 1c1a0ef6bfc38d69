#!/usr/bin/env bash
# Stop what tools/slurm/start.sh started: slurmd, slurmctld (scontrol shutdown ends both, and every running job) and
# munged. Its state (/var/spool/ppg-slurm) stays: start.sh starts it again with the jobs still queued.
set -uo pipefail
scontrol shutdown 2>/dev/null || true
if [ -f /run/munge/munged.pid ]; then kill "$(cat /run/munge/munged.pid)"; fi
for _ in $(seq 30); do  # until the daemons have gone
    if ! pidof slurmctld slurmd munged >/dev/null; then exit 0; fi
    sleep 1
done
echo "error: still running after 30 s: $(pidof slurmctld slurmd munged)" >&2
exit 1
