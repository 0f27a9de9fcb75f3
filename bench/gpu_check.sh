#!/usr/bin/env bash
# Issue 23's proof on one lent GPU: keel's CUDA tests, bench/triton_decode.py (the decode kernel's variants
# side by side), then bench/gpu_bench.py (greedy agreement with
# transformers in float32, batch-1 decode against the copy roofline, 256-request offline throughput
# against transformers' static batches). One run bounded at ~9 minutes (tests 150 s, kernel variants
# 90 s, bench 300 s, the install; 11 with --profile), nothing from a network.
#
#   bash bench/gpu_check.sh --fetch-wheels   # here, once: the wheels keel needs that the device image lacks -> .whl/
#   bash bench/gpu_check.sh [--profile]      # there (the device tool's run, carry [".whl"]): results under $OUT
#                                            # (--profile: then bench/gpu_profile.py, 150 s more at most)
#   bash bench/gpu_check.sh --train          # there, instead: issue 24's training on the GPU (~9 minutes):
#                                            # tests/test_cuda_train.py and test_train_run.py's one-process
#                                            # cases on the device, then bench/train.py on a 1.1B Llama (bf16,
#                                            # keel eager and compiled against a transformers loop: tokens/s, MFU)
#
# The device image has torch 2.11 + CUDA 13, triton, transformers, pytest, numpy, safetensors, tokenizers,
# jinja2, tqdm, httpx and prometheus-client; keel's other dependencies travel as wheels for its Python (3.12),
# pinned as in constraints.txt. keel runs from this source tree (PYTHONPATH=src): its C++ CPU kernels are
# not built there (nothing on the CUDA path calls them; keel.kernels reports them off).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="gguf==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0"

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl $WHEELS
  ls .whl
  exit 0
fi

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' | tee -a "$OUT/device.txt"

status=0
if [ "${1:-}" = "--train" ]; then
  # The one-process cases of test_train_run.py (its --nproc 2 cases need a GPU per rank; its bit-exact resume
  # and deterministic-kernel cases assume the CPU's kernels: test_cuda_train.py resumes on the device with and
  # without deterministic ones). ~220 s on 2 CPU cores with KEEL_GPU_TESTS_ON_CPU=1.
  one_process="learns_logs or resumed_runs_schedule or rng_states or profile_writes or run_device"
  one_process="$one_process or guard_skips_nan or rollback_skips or skipped_steps_in_a_row"
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/test_cuda_train.py \
    tests/test_train_run.py -k "test_cuda_train or $one_process" 2>&1 | tee "$OUT/train_tests.log" || status=1
  # The runs' tokenizer (checkpoints save it): the tests' byte-level one, as no catalog model travels here.
  python3 -c 'import sys; sys.path.insert(0, "tests"); from tiny_models import save_byte_tokenizer, save_hf_model
save_hf_model("llama", "/tmp/train_tok"); save_byte_tokenizer("/tmp/train_tok")'
  timeout 210 python3 bench/train.py --device cuda --model 1b --seq-len 2048 --batch 4 --micro 4 --steps 6 \
    --compile --tokenizer /tmp/train_tok 2>&1 | tee "$OUT/train_bench.log" || status=1
  exit $status
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_attention_backends.py \
  2>&1 | tee "$OUT/tests.log" || status=1
timeout 90 python3 bench/triton_decode.py --out "$OUT/triton_decode.json" 2>&1 | tee "$OUT/triton_decode.log" || status=1
timeout 300 python3 bench/gpu_bench.py --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
if [ "${1:-}" = "--profile" ]; then  # where the steps' time goes (bench/gpu_profile.py), bounded at 150 s
  timeout 150 python3 bench/gpu_profile.py --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log" || status=1
fi
exit $status
