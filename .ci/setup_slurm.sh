#!/usr/bin/env bash
# Install and start a single-node Slurm (controller + node on this machine) for the control
# plane's tests. Debian 12, as root, no systemd. Idempotent: safe to run again; it restarts
# nothing that already answers. Appends `export RUNYARD_TEST_SLURM=1` to .ci/env when Slurm works.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fixtures="$repo_root/tests/control/fixtures/slurm"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm slurm-client munge >/dev/null
fi

# munge: a key, its directories, the daemon.
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n </dev/null >/dev/null 2>&1; then
  if id munge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "/usr/sbin/munged" || /usr/sbin/munged --force
  else
    /usr/sbin/munged --force
  fi
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
fi

# slurm.conf from the fixture, filled in for this machine.
host="$(hostname -s)"
cpus="$(nproc)"
memory_mb="$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))"
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
render() { sed -e "s/@HOST@/$host/g" -e "s/@CPUS@/$cpus/g" -e "s/@MEMORY_MB@/$memory_mb/g" "$1"; }
render "$fixtures/slurm.conf.in" >/etc/slurm/slurm.conf.new
render "$fixtures/gres.conf.in" >/etc/slurm/gres.conf
touch /var/spool/slurmd/fake-gpu0 /var/spool/slurmd/fake-gpu1
changed=0
if ! cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf || [ "$(cat /etc/slurm/gres.conf)" != "$(cat /etc/slurm/.gres.applied 2>/dev/null)" ]; then
  cp /etc/slurm/gres.conf /etc/slurm/.gres.applied
  mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
  changed=1
else
  rm /etc/slurm/slurm.conf.new
fi
grep -q "[[:space:]]$host\b" /etc/hosts || echo "127.0.0.1 $host" >>/etc/hosts

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$changed" = 1 ]; then  # a new config: restart what runs with the old one
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if running "$pidfile"; then kill "$(cat "$pidfile")"; sleep 1; fi
  done
fi
running /run/slurmctld.pid || /usr/sbin/slurmctld
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
running /run/slurmd.pid || /usr/sbin/slurmd
# Wait for the node to come up idle; bring it back if an earlier run left it down/drained.
for _ in $(seq 100); do
  state="$(sinfo -h -N -o '%T' 2>/dev/null | head -1)"
  case "$state" in
    idle*|mixed*|allocated*) break ;;
    down*|drain*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 0.2
done
sinfo -h -N -o '%N %T %c %G'

mkdir -p "$repo_root/.ci"
grep -qx 'export RUNYARD_TEST_SLURM=1' "$repo_root/.ci/env" 2>/dev/null || echo 'export RUNYARD_TEST_SLURM=1' >>"$repo_root/.ci/env"
