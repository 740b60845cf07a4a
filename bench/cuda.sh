#!/usr/bin/env bash
# The CUDA paths in one run, for a machine with one GPU (CI has none):
#   roundtrip  the save path bit for bit on the device (fences, wait_staged, both staging
#              paths, a restore into another layout by sha256): bench/cuda_roundtrip.py
#   state4     a save's blocked time and a restore into device memory, 4 GiB of model +
#              Adam state, beside DCP, torch.save and a pinned copy: bench/cuda_state.py
#   lightning  Lightning in bf16 on the GPU, its own save beside ours, restores by hash
#   hf         the HF Trainer likewise
#   state16    bench/cuda_state.py at 16 GiB
#   loop       a training loop saving every 5 steps (bench/checkpoint.py --mode loop)
#   single     the single-process save/load figures (bench/checkpoint.py --mode single)
# Each part has its own time limit, so one that fails or hangs leaves the others'
# figures; every part's whole output is in LOG_DIR.
#
# Usage: bench/cuda.sh [LOG_DIR]
#   PARTS="roundtrip state4 ..." picks parts (default: roundtrip state4 lightning hf
#   state16); DEVICE=cpu runs them on the CPU, at small sizes, to try them out. Without
#   CUDA (and DEVICE unset) it says CUDA is absent and runs nothing. SMOKE=1 (what the
#   test suite runs) is DEVICE=cpu and the roundtrip part (PARTS picks others), each part
#   at its --smoke sizes. It exits 1 if a part failed.
set -u
cd "$(dirname "$0")/.."
logs=${1:-build/cuda}
smoke=${SMOKE:-0}
if [ "$smoke" = 1 ]; then
    device=${DEVICE:-cpu} parts=${PARTS:-roundtrip} extra=(--smoke)
else
    device=${DEVICE:-cuda} parts=${PARTS:-roundtrip state4 lightning hf state16} extra=()
fi
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ "$device" = cuda ] && ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() else 1)"; then
    echo "CUDA is absent: nothing measured (DEVICE=cpu bench/cuda.sh runs the parts on the CPU)"
    exit 0
fi
mkdir -p "$logs"
if [ "$device" = cuda ]; then
    small=() mib=256 mid=4 big=16
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
elif [ "$smoke" = 1 ]; then
    small=(--width 128) mib=1 mid=0.02 big=0.02  # the sizes of each bench's --smoke
else
    small=(--width 256) mib=8 mid=0.1 big=0.2  # the same paths, sized for a try on the CPU
fi
failed=0
"$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
df -h "${TMPDIR:-/tmp}" /dev/shm build 2>/dev/null | sed 's/^/  /'
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $* ${extra[*]}"
    local started=$SECONDS
    timeout "$limit" "$@" "${extra[@]}" > "$logs/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] || failed=1
    grep -v -e "tensors bit for bit$" -e "cannot reach" "$logs/$name.log" | tail -40
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
}
for p in $parts; do
    case $p in
    roundtrip) part roundtrip 80 "$py" bench/cuda_roundtrip.py --device "$device" ;;
    state4) part state4 130 "$py" bench/cuda_state.py --device "$device" --gib "$mid" "${small[@]}" ;;
    lightning) part lightning 90 "$py" bench/frameworks_lightning.py --device "$device" --bf16 \
        --mib "$mib" --repeat 3 ;;
    hf) part hf 90 "$py" bench/frameworks_hf_deepspeed.py --device "$device" --bf16 \
        --mib "$mib" --repeat 3 ;;
    state16) part state16 220 "$py" bench/cuda_state.py --device "$device" --gib "$big" "${small[@]}" ;;
    loop) part loop 240 "$py" bench/checkpoint.py --mode loop --device "$device" \
        --mib "${LOOP_MIB:-512}" --steps 20 --repeat 2 ;;
    single) part single 240 "$py" bench/checkpoint.py --mode single --only local \
        --device "$device" --mib "${SINGLE_MIB:-2048}" --tensors 64 --repeat 2 ;;
    *) echo "unknown part: $p"; failed=1 ;;
    esac
done
exit "$failed"
