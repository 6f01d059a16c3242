#!/usr/bin/env bash
# The expert-projection op's GPU checks, in the order they matter, each step's output kept in OUT_DIR/STEP.txt:
#
#   bash benchmarks/gpu.sh OUT_DIR                   # every step
#   bash benchmarks/gpu.sh OUT_DIR profile frozen    # only these steps
#
# Steps, in this order:
#   tests    the kernel tests on CUDA tensors (compiled kernels) against the float64 loop
#   table    the GPU table: % of cuBLAS
#   profile  where the GPU time of a call goes, N = 16384
#   host     the host time of a call, the op and project, and where cProfile sees it go (bf16, N = 1, 256, 4096
#            and 16384); then the same host's time by `--simulated` (N = 1 and 256) in host-simulated.txt, to set
#            the estimate made without a GPU beside it
#   launch   project's wall time per call with its kernels launched through Triton's launch path and directly,
#            decoding and forward + backward (bf16, N = 1, 256, 4096 and 16384)
#   graphs   project's wall time per call, eager and replayed from a CUDA graph, decoding and forward + backward
#            (bf16, N = 1, 256, 4096 and 16384); a call that cannot be captured is reported, not timed
#   frozen   forward + backward with the weight trained and frozen
#   dense    the PyTorch dense regime (every expert of a head in one cuBLAS GEMM) and the grouped_mm regime
#            (torch's grouped GEMM over the expert-sorted pairs) beside the Triton kernels, the kernels with grad_x
#            and/or the weight gradient by cuBLAS, and the op as it runs by default (bf16, N = 1024, 4096, 16384)
#   splits   the kernels' backward with the weight gradient's pairs in 1, 2, 4 and 8 chunks per expert, beside
#            the count the geometry picks (bf16, N = 4096 and 16384)
#   against  only when named: the Triton kernels beside themselves as of AGAINST, a git revision or a directory
#            holding an old checkout, e.g. one made with `git worktree add scratch/old REV` (bf16, N = 4096, 16384)
# A step that fails stops the run: timings of kernels that fail their tests mean nothing.
# PYTHON picks the interpreter (default: python3).
set -euo pipefail

steps_all=(tests table profile host launch graphs frozen dense splits)
steps_named=("${steps_all[@]}" against)  # run only when named
if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: [AGAINST=REV] bash benchmarks/gpu.sh OUT_DIR [${steps_named[*]}]" >&2
    exit 2
fi
out=$1
shift
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=("${steps_all[@]}")
for step in "${steps[@]}"; do
    if [[ " ${steps_named[*]} " != *" $step "* ]]; then
        echo "gpu.sh: unknown step '$step'; steps: ${steps_named[*]}" >&2
        exit 2
    fi
    if [[ $step == against && -z ${AGAINST:-} ]]; then
        echo "gpu.sh: the step 'against' needs AGAINST=REV (a git revision or an old checkout's directory)" >&2
        exit 2
    fi
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA device visible to $python; these steps need one" >&2
    exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

run() {
    local step=$1
    shift
    echo "== $step: $*" | tee "$out/$step.txt"
    (cd "$root/benchmarks" && "$@") 2>&1 | tee -a "$out/$step.txt"
}

for step in "${steps[@]}"; do
    case $step in
        tests)
            # One worker per core where pytest-xdist is there: most of the time is Triton compiling kernels.
            workers=()
            "$python" -c "import xdist" 2>/dev/null && workers=(-n auto)
            run tests env SWITCHHEAD_TEST_DEVICE=cuda "$python" -m pytest -q -p no:cacheprovider "${workers[@]}" \
                ../tests/test_kernels.py ;;
        table) run table "$python" kernels.py --no-cpu ;;
        profile) run profile "$python" kernel_profile.py --n 16384 --other ;;
        host)
            run host "$python" kernels.py --n 1 256 4096 16384 --host --dtype bfloat16
            run host-simulated "$python" kernels.py --n 1 256 --host --simulated --dtype bfloat16 ;;
        launch) run launch "$python" kernels.py --n 1 256 4096 16384 --launch --dtype bfloat16 ;;
        graphs) run graphs "$python" kernels.py --n 1 256 4096 16384 --graphs --dtype bfloat16 ;;
        frozen) run frozen "$python" kernels.py --frozen --device cuda --n 4096 16384 ;;
        dense) run dense "$python" kernels.py --n 1024 4096 16384 --regimes dense grouped_mm --device cuda --dtype bfloat16 ;;
        splits) run splits "$python" kernels.py --n 4096 16384 --weight-grad-splits 1 2 4 8 --dtype bfloat16 ;;
        against)
            # a relative directory is the repository's
            against=$AGAINST
            [[ -d $root/$against ]] && against=$root/$against
            run against "$python" kernels.py --n 4096 16384 --device cuda --dtype bfloat16 --against "$against" ;;
    esac
done
echo "gpu.sh: done; outputs in $out"
