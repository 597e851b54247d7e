#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs Infinity into it,
# compiling the native extension. Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${INFINITY_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "Infinity needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first and with a ceiling, so that pip takes the CPU build of 2.13 where it is on disk
# instead of pulling a multi-gigabyte CUDA build of a newer release.
"${pip[@]}" install 'torch>=2.3,<2.14'
"${pip[@]}" install -e "$root[test]"
