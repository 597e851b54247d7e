#!/usr/bin/env bash
# Install the benchmark peers (fio, DeepSpeed's async_io handle, CPU Adam and ZeRO-3 with transformers,
# Accelerate's disk offload) for tools/bench_io.py, tools/bench_adam.py, tools/bench_train.py and
# tools/bench_infer.py.
#
# Benchmark-only: nothing here is a dependency of Infinity itself. Idempotent: every step
# checks whether its result is already there and skips it if so, so a second run takes seconds.
#
#   bash tools/peers/setup_peers.sh
#
# Environment:
#   INFINITY_PEERS_DIR     where the venv and compiled ops live (default /var/tmp/infinity-peers)
#   INFINITY_PEERS_PYTHON  interpreter used to create the venv (default: python3.11, else python3)
#   INFINITY_PEERS_SKIP_APT=1      do not touch apt even when root
#   INFINITY_PEERS_SKIP_COMPILE=1  do not pre-compile DeepSpeed's async_io and cpu_adam ops
#   INFINITY_PEERS_DEEPSPEED       pip requirement for DeepSpeed (default: deepspeed, i.e. the newest;
#                                  tested with deepspeed==0.19.8)
#
# Layout afterwards:
#   $INFINITY_PEERS_DIR/venv/bin/python       python with torch (CPU wheel) + deepspeed
#   $INFINITY_PEERS_DIR/torch_extensions/     DeepSpeed's JIT-compiled ops (async_io, cpu_adam), reused later
#   $INFINITY_PEERS_DIR/env.sh                exports DS_ACCELERATOR / TORCH_EXTENSIONS_DIR
set -euo pipefail

PEERS_DIR="${INFINITY_PEERS_DIR:-/var/tmp/infinity-peers}"
VENV="$PEERS_DIR/venv"
EXT_DIR="$PEERS_DIR/torch_extensions"
TORCH_VERSION="2.13.0"
WHEELS_DIR="/opt/wheels"

log() { printf '[setup_peers] %s\n' "$*" >&2; }
t_start=$(date +%s)

mkdir -p "$PEERS_DIR" "$EXT_DIR"

# --------------------------------------------------------------------------- apt: fio, libaio-dev
apt_ok=1
if [[ "${INFINITY_PEERS_SKIP_APT:-0}" == "1" ]]; then
    log "apt: skipped (INFINITY_PEERS_SKIP_APT=1)"
elif command -v fio >/dev/null 2>&1 && dpkg -s libaio-dev >/dev/null 2>&1; then
    log "apt: fio and libaio-dev already installed"
elif ! command -v apt-get >/dev/null 2>&1; then
    log "apt: apt-get not found; install fio and libaio-dev (libaio headers) by hand"
    apt_ok=0
elif [[ "$(id -u)" != "0" ]]; then
    log "apt: not root; run as root or: sudo apt-get install -y fio libaio-dev"
    apt_ok=0
else
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y fio libaio-dev; then
        # Fresh machines may have empty package lists: refresh once and retry.
        log "apt: install failed, running apt-get update and retrying"
        apt-get update && apt-get install -y fio libaio-dev || apt_ok=0
    fi
fi
if [[ $apt_ok == 0 ]]; then
    log "apt: continuing without fio/libaio-dev; fio benchmarks and DeepSpeed's async_io op need them"
fi

# --------------------------------------------------------------------------- venv
pick_python() {
    if [[ -n "${INFINITY_PEERS_PYTHON:-}" ]]; then echo "$INFINITY_PEERS_PYTHON"; return; fi
    # The local CPU torch wheel is cp311; prefer a 3.11 interpreter.
    for p in python3.11 python3; do
        if command -v "$p" >/dev/null 2>&1; then command -v "$p"; return; fi
    done
    echo ""
}
if [[ ! -x "$VENV/bin/python" ]]; then
    PY="$(pick_python)"
    if [[ -z "$PY" ]]; then log "no python3 found"; exit 1; fi
    log "creating venv $VENV with $PY ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV"
else
    log "venv: $VENV exists"
fi
VPY="$VENV/bin/python"
VPIP=("$VPY" -m pip --disable-pip-version-check)

# Our own constraints (pip's global constraint file, if any, still applies): pin torch so that
# neither step below can replace the CPU wheel with another (e.g. a CUDA build, gigabytes).
CONSTRAINTS="$PEERS_DIR/constraints.txt"
TORCH_REQ="torch==$TORCH_VERSION"
if compgen -G "$WHEELS_DIR/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
    # A local CPU wheel: ask for it by its full version so pip cannot pick the plain
    # (CUDA-dependent) 2.13.0 from an index instead.
    TORCH_REQ="torch==$TORCH_VERSION+cpu"
fi
echo "$TORCH_REQ" > "$CONSTRAINTS"

have_torch() {
    "$VPY" - "$TORCH_VERSION" <<'EOF' 2>/dev/null
import sys
import torch
v = torch.__version__
sys.exit(0 if v.split("+")[0] == sys.argv[1] and torch.version.cuda is None else 1)
EOF
}
have_mods() { "$VPY" -c "import $1" >/dev/null 2>&1; }

if have_torch && have_mods "ninja, cpuinfo, psutil"; then
    log "pip: torch $TORCH_VERSION (CPU) and ninja/py-cpuinfo/psutil already installed"
else
    log "pip: installing $TORCH_REQ ninja py-cpuinfo psutil"
    "${VPIP[@]}" install -c "$CONSTRAINTS" "$TORCH_REQ" ninja py-cpuinfo psutil
fi
if ! have_torch; then
    log "pip: torch in $VENV is not the CPU build of $TORCH_VERSION; refusing to go on"
    "$VPY" -c "import torch; print(torch.__version__, torch.version.cuda)" >&2 || true
    exit 1
fi
if "${VPIP[@]}" list 2>/dev/null | grep -qi '^nvidia-'; then
    log "pip: warning: nvidia-* packages present in $VENV (CUDA libraries); they are not needed"
fi

if "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
    log "pip: deepspeed $("$VPY" -c 'from importlib.metadata import version; print(version("deepspeed"))' 2>/dev/null) already installed"
else
    # setup.py imports torch, hence --no-build-isolation; DS_BUILD_OPS=0: ops are JIT-compiled later.
    DS_REQ="${INFINITY_PEERS_DEEPSPEED:-deepspeed}"
    log "pip: installing $DS_REQ (DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${VPIP[@]}" install -c "$CONSTRAINTS" --no-build-isolation "$DS_REQ"
fi

# transformers: tools/bench_train.py builds the same GPT-2 (from a config, seeded) inside DeepSpeed's worker.
if have_mods "transformers"; then
    log "pip: transformers already installed"
else
    log "pip: installing transformers (for the ZeRO-3 training worker)"
    "${VPIP[@]}" install -c "$CONSTRAINTS" "transformers>=4.40" safetensors
fi

# accelerate: tools/bench_infer.py's disk-offload peer (transformers' device_map with max_memory).
if have_mods "accelerate"; then
    log "pip: accelerate already installed"
else
    log "pip: installing accelerate (for the disk-offload generation worker)"
    "${VPIP[@]}" install -c "$CONSTRAINTS" accelerate
fi

cat > "$PEERS_DIR/env.sh" <<EOF
# source this before using $VENV/bin/python with DeepSpeed
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="$EXT_DIR"
EOF

# --------------------------------------------------------------------------- async_io op
if [[ "${INFINITY_PEERS_SKIP_COMPILE:-0}" == "1" ]]; then
    log "async_io: compile skipped (INFINITY_PEERS_SKIP_COMPILE=1)"
elif ! dpkg -s libaio-dev >/dev/null 2>&1 && [[ ! -e /usr/include/libaio.h ]]; then
    log "async_io: libaio headers missing (libaio-dev); not compiling the op"
else
    log "async_io: loading (JIT-compiled into $EXT_DIR on first use, 2-4 minutes; reused after)"
    t0=$(date +%s)
    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$EXT_DIR" "$VPY" - <<'EOF'
import sys
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder()
if not b.is_compatible(verbose=True):
    print("async_io: DeepSpeed reports the op as not compatible here", file=sys.stderr)
    sys.exit(1)
mod = b.load(verbose=False)
h = mod.aio_handle(1 << 20, 8, False, True, 1)
print(f"async_io: ok, handle block_size={h.get_block_size()} queue_depth={h.get_queue_depth()}",
      file=sys.stderr)
EOF
    log "async_io: ready in $(( $(date +%s) - t0 )) s"
fi

# --------------------------------------------------------------------------- cpu_adam op
# DeepSpeedCPUAdam (tools/bench_adam.py) and ZeRO-3's offloaded optimizer (tools/bench_train.py) use it.
if [[ "${INFINITY_PEERS_SKIP_COMPILE:-0}" == "1" ]]; then
    log "cpu_adam: compile skipped (INFINITY_PEERS_SKIP_COMPILE=1)"
else
    log "cpu_adam: loading (JIT-compiled into $EXT_DIR on first use, about a minute; reused after)"
    t0=$(date +%s)
    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$EXT_DIR" "$VPY" - <<'EOF'
import sys
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load(verbose=False)
print("cpu_adam: ok", file=sys.stderr)
EOF
    log "cpu_adam: ready in $(( $(date +%s) - t0 )) s"
fi

log "done in $(( $(date +%s) - t_start )) s; python: $VPY; env: source $PEERS_DIR/env.sh"
