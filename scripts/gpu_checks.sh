#!/usr/bin/env bash
# Every GPU check of the sandbox, in one run, for a machine with an NVIDIA GPU (about 5 to
# 10 minutes on one H200). Results go to the folder given as $1:
#   environment.txt   nvidia-smi, nvcc, torch and the sandbox's own view of the devices
#   gpu-tests.txt     pytest -m gpu (junit XML beside it)
#   bench.txt         the GPU part of benchmarks/bench_sandbox.py (results.json in bench/)
#   demo.txt          `leap demo` for two steps: the LEAP loop on the cuda toolchain, the learner
#                     in bf16 autocast on the GPU (report.json in demo/)
# Exit status: that of the tests.
#
#   scripts/gpu_checks.sh runs/gpu-checks
set -u
out="${1:?usage: scripts/gpu_checks.sh OUTPUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
python=".venv/bin/python"
[ -x "$python" ] || python="$(command -v python3)"

{
  echo "== nvidia-smi"; nvidia-smi 2>&1
  echo "== nvcc"; nvcc --version 2>&1
  echo "== torch"; "$python" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count() and torch.cuda.get_device_name(0))' 2>&1
  echo "== sandbox"; "$python" - <<'PY' 2>&1
from svc_sandbox import compilers
from svc_sandbox.telemetry import Telemetry
nvml = Telemetry()
print("nvml devices:", [(d.index, d.name, d.compute_capability, d.driver_version) for d in nvml.devices], nvml.unavailable_reason)
nvcc = compilers.find("nvcc")
print("nvcc:", nvcc and nvcc.version, "cuda libraries:", nvcc and nvcc.target)
PY
} > "$out/environment.txt"
cat "$out/environment.txt"

timeout 480 "$python" -m pytest -m gpu tests -q -rA -p no:cacheprovider --junitxml "$out/gpu-tests.xml" 2>&1 \
  | tee "$out/gpu-tests.txt"
status=${PIPESTATUS[0]}

timeout 300 "$python" benchmarks/bench_sandbox.py --gpu-only --out "$out/bench" 2>&1 | tee "$out/bench.txt"

timeout 420 "$python" -m leap demo --steps 2 --tasks-per-step 4 --eval-samples 2 --quiet --out "$out/demo" 2>&1 \
  | tee "$out/demo.txt"
exit "$status"
