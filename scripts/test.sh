#!/usr/bin/env bash
# The test suite: installs Infinity with its test extras, then runs pytest (real daemons, real disks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
cd "$root"
# The suite starts hundreds of Python children (daemons, trainers, torchrun ranks); without cached
# bytecode each compiles the package from source again (about 0.17 s of a daemon's 0.37 s start).
# Some machines set PYTHONDONTWRITEBYTECODE; the cache goes beside the venv, not into the tree.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${INFINITY_VENV:-$root/.venv}/pycache}"
# One pytest worker per core, at most 4: the tests start daemons, trainers and torchrun jobs of
# their own, and serial they used about one core of two. INFINITY_TEST_WORKERS overrides (1: serial).
workers="${INFINITY_TEST_WORKERS:-$(nproc)}"
if [ "$workers" -gt 4 ]; then workers=4; fi
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist worksteal); fi
exec "${INFINITY_VENV:-$root/.venv}/bin/python" -m pytest "${parallel[@]}" "$@"
