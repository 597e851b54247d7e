#!/usr/bin/env bash
# The main job on its built-in default: installs Infinity, starts infinityd in a private runtime
# folder under ./.infinity-demo, runs the demonstration through it, and stops the daemon.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
cd "$root"
exec "${INFINITY_VENV:-$root/.venv}/bin/infinity" demo "$@"
