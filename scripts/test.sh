#!/usr/bin/env bash
# The test suite: installs Infinity with its test extras, then runs pytest (real daemons, real disks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
cd "$root"
# One pytest worker per core, at most 4: the tests start daemons, trainers and torchrun jobs of
# their own, and serial they used about one core of two. INFINITY_TEST_WORKERS overrides (1: serial).
workers="${INFINITY_TEST_WORKERS:-$(nproc)}"
if [ "$workers" -gt 4 ]; then workers=4; fi
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist worksteal); fi
exec "${INFINITY_VENV:-$root/.venv}/bin/python" -m pytest "${parallel[@]}" "$@"
