#!/usr/bin/env bash
# Install (never start) a single-node SLURM + munge for tests/integration/test_slurm.py.
#
# Debian/Ubuntu only, needs root. Idempotent: does nothing when the binaries are already there.
# The test fixture starts munged/slurmctld/slurmd itself in a temp dir and stops them at teardown
# (see docs/slurm.md and tests/integration/slurm_cluster.py). CI then runs pytest with
# BYTELATENT_REQUIRE_SLURM=1 so that a missing SLURM fails the test instead of skipping it.
set -euo pipefail

# procps: the generated batch scripts forward signals with pkill. iproute2: the two-node test
# cluster puts each slurmd in a network namespace (`ip netns`).
PACKAGES=(slurmctld slurmd slurm-client munge procps iproute2)

missing=0
for binary in slurmctld slurmd sbatch munged pkill ip; do
    command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ] || missing=1
done
if [ "$missing" = 0 ]; then
    echo "ci_slurm_setup: slurm and munge already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "ci_slurm_setup: must run as root to apt-get install ${PACKAGES[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ci_slurm_setup: apt-get not found; install ${PACKAGES[*]} with your package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# The packages' init scripts are blocked by policy-rc.d in containers ("denied execution of
# start"): that is expected, nothing should run until the test starts its own daemons.
apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
echo "ci_slurm_setup: installed ${PACKAGES[*]}"
