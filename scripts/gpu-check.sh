#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU, Python 3.11+, torch (CUDA) and cuda-bindings:
# exercises allocator.CudaBackend for real (no vLLM, no SGLang, no network; < 5 min) and
# prints a PASS/FAIL/SKIP table. Exit status 1 if a row failed, 2 if no CudaBackend here.
#
#   bash scripts/gpu-check.sh                      # on the GPU machine
#   bash scripts/gpu-check.sh --device 1           # another GPU
#   bash scripts/gpu-check.sh --fake-driver PATH   # CI: the stand-in driver (tests/fakecuda);
#                                                  # the rows that need kernels say SKIP
# PYTHON picks the interpreter (default python3). See README.md, "What is GPU-only".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$root/scripts/gpu_check.py" "$@"
