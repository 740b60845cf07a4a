#!/usr/bin/env bash
# The CUDA paths in one run, for a machine with one GPU (CI has none): the bit-for-bit
# round trip through both staging paths, the training loop with overlapped saves beside
# dcp.async_save, and the single-process save/load figures beside their anchors. Each
# part has its own time limit, so one that fails or hangs leaves the others' figures.
#
# Usage: bench/cuda.sh [LOG_DIR]   (DEVICE=cpu runs the same on the CPU, to try it out)
set -u
cd "$(dirname "$0")/.."
logs=${1:-build/cuda}
device=${DEVICE:-cuda}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    grep -v -e "bit for bit" -e "cannot reach" "$logs/$name.log" | tail -40
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
}
part roundtrip 120 "$py" bench/cuda_roundtrip.py --device "$device"
part loop 240 "$py" bench/checkpoint.py --mode loop --device "$device" \
    --mib "${LOOP_MIB:-512}" --steps 20 --repeat 2
part single 240 "$py" bench/checkpoint.py --mode single --only local --device "$device" \
    --mib "${SINGLE_MIB:-2048}" --tensors 64 --repeat 2
