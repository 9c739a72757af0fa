#!/usr/bin/env bash
# Every GPU check of a lent device session in one command (issue 15), run from the
# repository root on the GPU machine with the Fashion-MNIST .gz files carried in .gpu_data
# (see bench/gpu_check.py's docstring). Writes at most 8 files to $OUT:
#   env.txt            nvidia-smi, torch and CUDA versions
#   pytest_device.log  tests/test_device.py with CUDA present (its needs_cuda tests run)
#   dist.log           2 ranks sharing the GPU over gloo: hardsync (DDP) and the parameter
#                      server (host staging), their summaries; a GPU checkpoint resumed on CPU
#   gpu_check.log      bench/gpu_check.py's output; gpu_check_<device>.md / .json beside it
# Each step has its own timeout so one hang leaves the others' output.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/gpu_out}
DATA=${DATA:-.gpu_data}
mkdir -p "$OUT"
{
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
    nproc
} >"$OUT/env.txt" 2>&1

timeout 100 python3 -m pytest -o addopts="" -q -p no:cacheprovider -m "not slow" \
    tests/test_device.py 2>&1 | tee "$OUT/pytest_device.log" | tail -5

{
    common=(--set "data.root=$DATA" --set train.max_samples=12800 --set train.max_epochs=0
        --set train.eval_every_samples=6400 --set "train.device=${DEVICE:-cuda}" --quiet)
    echo "== hardsync, 2 ranks on one GPU (gloo)"
    timeout 70 python3 -m distsgd train configs/hardsync.toml --runtime dist \
        --num-processes 2 "${common[@]}" --out /tmp/gs_hard && cat /tmp/gs_hard/summary.json
    echo "== parameter server async, 1 server + 2 learners on one GPU (gloo, host staging)"
    timeout 70 python3 -m distsgd train configs/async.toml --runtime dist \
        --num-processes 3 "${common[@]}" --out /tmp/gs_ps && cat /tmp/gs_ps/summary.json
    echo "== the GPU hardsync checkpoint resumed on the CPU"
    timeout 60 python3 -m distsgd train --resume /tmp/gs_hard --set train.device=cpu \
        --set train.max_samples=19200 --quiet && cat /tmp/gs_hard/summary.json
} 2>&1 | tee "$OUT/dist.log" | grep -E '^==|"status"|"final_metric"|Error|error' | head -20

timeout "${GPU_CHECK_TIMEOUT:-330}" python3 bench/gpu_check.py --data-root "$DATA" \
    --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
