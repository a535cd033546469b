#!/usr/bin/env bash
# The policy service's GPU checks, for a machine with an NVIDIA GPU (a few minutes):
#   scripts/gpu_checks_policy.sh OUT_DIR
# runs the @pytest.mark.gpu tests of the policy (hf backend on CUDA in float32 and bfloat16;
# the vllm backend where the vllm package imports) and the Generate/Score benchmark on the
# GPU, and writes logs and a summary to OUT_DIR.
#
# Python packages the machine lacks can come as wheels in .whl/ (installed with --no-index
# into /tmp/site first); torch, transformers and grpcio are expected to be there already.
set -uo pipefail
out="${1:?usage: scripts/gpu_checks_policy.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  $python -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not installed (its test skips)"
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

missing=$($python - <<'EOF'
import importlib
names = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
         "grpc_status": "grpcio-status", "structlog": "structlog", "google.rpc": "googleapis-common-protos",
         "pytest": "pytest", "safetensors": "safetensors", "tokenizers": "tokenizers", "tqdm": "tqdm"}
print(" ".join(pip for module, pip in names.items() if importlib.util.find_spec(module.split(".")[0]) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "missing Python packages: $missing (carry them as wheels in .whl/)" | tee "$out/summary.txt"
  exit 1
fi

status=0
timeout 420 $python -m pytest tests/test_policy_gpu.py -m gpu -q -rA -p no:cacheprovider \
  --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 240 $python - <<'EOF' 2>&1 | tee "$out/bench_gpu.log" || status=1
# Generate and Score on the GPU, in-process (the hf backend), for the record.
import statistics, time, torch
from leap.bootstrap import bootstrap_model
from leap.policy.v1 import policy_pb2
from leap import prompts
from svc_policy.engine import Job, Sample
from svc_policy.hf_backend import HFEngine
from svc_policy.text import render_prompt
from tests.conftest import BOOTSTRAP_CACHE, task_suite
model = bootstrap_model(tasks=task_suite(), cache_dir=BOOTSTRAP_CACHE, progress=False)
tasks = [t for t in task_suite() if t.split == "train"]
for dtype in ("float32", "bfloat16"):
    engine = HFEngine(model, device="cuda", dtype=dtype)
    ids = [render_prompt(engine.tokenizer, policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t)))) for t in tasks]
    samples = [Sample(p, i, j, 1.0, 0, 1.0, 256, [], frozenset(), 0) for i, p in enumerate(ids) for j in range(8)]
    times = []
    for _ in range(3):
        results = []
        job = Job(samples, results.append)
        start = time.perf_counter(); engine.submit(job); job.done.result(); times.append(time.perf_counter() - start)
    tokens = sum(len(r.token_ids) for r in results)
    items = [(r.sample.prompt_ids, r.token_ids) for r in results if r.token_ids]
    start = time.perf_counter(); engine.score(items, 1.0, 0, 1.0).result(); score_s = time.perf_counter() - start
    print(f"hf cuda {dtype}: {len(samples)} samples, {tokens} tokens, generate {tokens / statistics.median(times):.0f} tok/s, "
          f"score {sum(len(p) + len(c) for p, c in items) / score_s:.0f} tok/s")
    engine.close()
EOF
grep -E "passed|failed|skipped|error" "$out/gpu_tests.log" | tail -1 > "$out/summary.txt"
grep "tok/s" "$out/bench_gpu.log" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $status
