#!/usr/bin/env bash
# FP8 on the GPU machine (issue 24), in one call: the FP8 GPU tests, the FP8 GEMM benchmark, and pairs.py --dtype fp8
# on W1 (0.6B shape) and the 4B and 8B shapes (W1 with fewer docs there), each with its float32 fidelity check.
# Results land in ${OUT:-gpu_out}. Stages: tests kernels w1 w4 (default: all; about 7 minutes on an H100 is the aim:
# name fewer stages, or set FP8_W4_DOCS lower, when a call must be shorter). A stage's failure is printed and the
# next stage runs. Nine files come back, each stage's full output (every row is a JSON line in it). Set-up as in
# gpu_all.sh: carry .whl (pydantic & co. as cp312 wheels), then
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:.whl/minilm:src:tests && bash benchmarks/fp8_gpu.sh
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src:tests} PYTHONUNBUFFERED=1
stages=${*:-tests kernels w1 w4}
has() { [[ " $stages " == *" $1 "* ]]; }
stage() {  # stage NAME COMMAND...: run it, keep its output in $out/NAME.txt, print its tail and its exit status
  local name=$1; shift
  local begun=$SECONDS
  "$@" > "$out/$name.txt" 2>&1
  local status=$?
  echo "== $name: exit $status, $((SECONDS - begun)) s"
  tail -${TAIL:-40} "$out/$name.txt"
  return 0
}
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$out/device.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

has tests && TAIL=30 stage fp8_tests python3 -m pytest -q -m gpu -k "fp8" -p no:cacheprovider \
  tests/kernels/test_fp8_kernels.py tests/engine/test_fp8_dtype.py
# the warp-specialized Gluon GEMMs against the Triton kernels they stand in for, bit for bit
has tests && TAIL=15 stage gluon_gemm_tests python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_swiglu_ws.py tests/kernels/test_qkv_rope_ws.py
# the bf16 kernels' GPU tests too: their descriptor kernels now take a scales argument
has tests && TAIL=15 stage bf16_kernel_tests python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_swiglu_matmul.py tests/kernels/test_qkv_rope_matmul.py
has kernels && TAIL=14 stage fp8_matmul python3 benchmarks/fp8_matmul.py
has kernels && TAIL=20 stage swiglu_fp8_out python3 benchmarks/swiglu_fp8_out.py
has kernels && TAIL=8 stage qkv_epilogue python3 benchmarks/qkv_epilogue.py
has kernels && TAIL=16 stage swiglu_ws python3 benchmarks/swiglu_ws.py
# W1: the default projections (q/k/v and gate/up at 0.6B) beside all four
has w1 && TAIL=30 stage pairs_fp8_w1 python3 benchmarks/pairs.py --workloads W1 --dtype fp8 \
  --fp8-projections ";qkv,o,gate_up,down"
for shape in 4b 8b; do  # a process each: the 8B rows need the GPU to themselves
  has w4 && TAIL=30 stage "pairs_fp8_$shape" python3 benchmarks/pairs.py --workloads "" --w4 --w4-shapes $shape \
    --w4-docs "${FP8_W4_DOCS:-32}" --dtype fp8
done
exit 0
