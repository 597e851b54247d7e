#!/usr/bin/env bash
# The test suite: installs Infinity with its test extras, then runs pytest (real daemons, real disks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
cd "$root"
exec "${INFINITY_VENV:-$root/.venv}/bin/python" -m pytest "$@"
