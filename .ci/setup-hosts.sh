#!/usr/bin/env bash
# What the tests of several machines need from Debian, installed only when missing:
# openssh-server and pdsh (the two-host run: tests/hosts.py, tests/test_two_hosts.py),
# slurm-wlm and munge (the Slurm submission: tests/slurm_cluster.py, tests/test_slurm.py).
# Without root (or apt-get) nothing is installed and those tests skip with the reason.
set -euo pipefail
need=()
for pair in sshd:openssh-server pdsh:pdsh slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge; do
  tool="${pair%%:*}" package="${pair#*:}"
  if ! command -v "$tool" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$tool" ]; then
    case " ${need[*]-} " in *" $package "*) ;; *) need+=("$package") ;; esac
  fi
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-hosts: not installing ${need[*]} (needs root and apt-get); those tests will skip" >&2
  exit 0
fi
echo "setup-hosts: installing ${need[*]} (Debian packages) ..."
(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}") >/dev/null
