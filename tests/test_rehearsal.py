"""The recipe is one recipe (issue 66): the commands docs/scale.md and README give a GPU user are the rehearsal's
(scripts/rehearsal.py, `make rehearsal`), the model and the scaled budget aside; the recorder tells the roles apart
as 03 sends them; the rehearsal's screen marks what fails. The rehearsal itself runs in .ci/run, after make test."""

import importlib
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import recorder  # noqa: E402
import rehearsal  # noqa: E402


def gpu_lines() -> dict[str, str]:
    return {name: rehearsal.command(name, {**rehearsal.GPU, "run": "runs/mica-<time>"}) for name in rehearsal.RECIPE}


def test_the_pages_commands_are_the_rehearsals():
    """Every command of the recipe, with the GPU's model, window and reply length and without the rehearsal's budget,
    is on docs/scale.md's page; the one-GPU ones (serve, train, evaluate) are in README too."""
    page, readme = (ROOT / "docs" / "scale.md").read_text(), (ROOT / "README.md").read_text()
    lines = {name: rehearsal.RECIPE[name].format(**rehearsal.GPU, run="runs/mica-<time>") for name in rehearsal.RECIPE}
    for name, line in lines.items():
        assert line in page, name
    for name in ("serve", "train", "evaluate"):
        assert lines[name] in readme, name
    # the rehearsal runs the same lines with its budget added: nothing of the recipe changed
    for name, line in gpu_lines().items():
        assert line.startswith(lines[name]) and line[len(lines[name]) :] == (
            f" {rehearsal.BUDGET[name]}" if name in rehearsal.BUDGET else ""
        )


def test_the_dry_run_prints_the_scaled_commands():
    p = subprocess.run(
        [sys.executable, ROOT / "scripts" / "rehearsal.py", "--dry-run"], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert [x.split(":")[0] for x in out] == list(rehearsal.RECIPE)
    assert 'ENGINE_FLAGS="--max-model-len 1024' in out[0]
    assert all("--max-context 1024 --max-new-tokens 64" in x for x in out[1:])


def test_the_recorder_tells_the_roles_apart_as_03_sends_them():
    env = importlib.import_module("03_rollout")
    assert (recorder.JUDGE_MAX_TOKENS, recorder.USER_MAX_TOKENS) == (env.JUDGE_MAX_TOKENS, env.USER_MAX_TOKENS)
    usage = {"usage": {"prompt_tokens": 900}}
    judge = recorder.record("/v1/chat/completions", {"model": "m", "max_tokens": 200}, 200, usage)
    assert judge["role"] == "judge" and judge["request_tokens"] == 1100
    assert recorder.record("/v1/chat/completions", {"max_tokens": 120}, 200, usage)["role"] == "user"
    policy = recorder.record("/v1/completions", {"model": "m@x-1", "max_tokens": 64}, 200, usage)
    assert policy["role"] == "policy" and policy["model"] == "m@x-1" and policy["request_tokens"] == 964
    load = recorder.record("/v1/load_lora_adapter", {"lora_name": "m@x-1", "lora_path": "/p"}, 200, "")
    assert load["lora_name"] == "m@x-1" and "role" not in load


def test_the_screen_marks_a_request_over_the_window_and_a_stray_adapter(tmp_path):
    """One run of one step whose policy requests named the base, a judge request over the window, an adapter left:
    each is a FAIL row and the whole is not ok; the same without them is ok."""
    run = tmp_path / "run"
    run.mkdir()
    step = {"step": 1, "engine_policy_by_process": [["m@t-1"]], "sampler_gap_mean": 1e-5, "tis_weight_mean": 1.0}
    step.update(turns_mean=2.0, trajectories=2, judge_failures=1)
    (run / "metrics.jsonl").write_text(__import__("json").dumps(step) + "\n")
    load = {"t": 1.0, "path": "/v1/load_lora_adapter", "status": 200, "lora_name": "m@t-1"}

    def request(role, model, size, t=2.0):
        path = "/v1/completions" if role == "policy" else "/v1/chat/completions"
        return {"t": t, "path": path, "status": 200, "role": role, "model": model, "request_tokens": size}

    good = [load, request("policy", "m@t-1", 500), request("judge", "m", 1000), request("user", "m", 700)]
    phases = [rehearsal.Phase("train", 10.0, 0, tmp_path / "log")]
    runs = [("train", run, 0.0, 10.0, 1, 1)]
    text, ok = rehearsal.screen(phases, good, runs, [], 1024, "m")
    assert ok and "FAIL" not in text and "| train | 1 | 1 of 4 | 1e-05 | - | 1.0000 | - |" in text
    bad = good[:2] + [request("judge", "m", 1100), request("user", "m", 700), request("policy", "m", 500, 3.0)]
    text, ok = rehearsal.screen(phases, bad, runs, ["m@t-1"], 1024, "m")
    assert not ok
    assert "| judge | 1 | 0 | 1100 | 1024 | FAIL |" in text
    assert "| train | 1 | m@t-1 |" in text and "m x1" in text
    assert "Adapters left on the server at the end: m@t-1 (FAIL)" in text


def test_the_screen_counts_a_runs_own_steps_not_those_a_resume_appends_later(tmp_path):
    """CI's rehearsal failed here: 04 --resume appends step 3 to the train run's metrics.jsonl, and the train row
    counted 3 logged steps against its 2 pushes (a FAIL with no row). Each run counts its own steps; a mismatch is
    a row of its own."""
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for n in (1, 2, 3):
        step = {"step": n, "engine_policy_by_process": [[f"m@t-{n}"]], "sampler_gap_mean": None}
        step.update(turns_mean=1.0, trajectories=1, judge_failures=1, tis_weight_mean=None)
        lines.append(__import__("json").dumps(step))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    requests = []
    for n, t in ((1, 1.0), (2, 3.0), (3, 21.0)):
        requests.append({"t": t, "path": "/v1/load_lora_adapter", "status": 200, "lora_name": f"m@t-{n}"})
        requests.append({"t": t + 1, "path": "/v1/completions", "status": 200, "role": "policy", "model": f"m@t-{n}"})
        requests[-1]["request_tokens"] = 500
    for role in ("judge", "user"):
        requests.append({"t": 2.0, "path": "/v1/chat/completions", "status": 200, "role": role, "model": "m"})
        requests[-1]["request_tokens"] = 700
    phases = [rehearsal.Phase("train", 10.0, 0, tmp_path / "log")]
    runs = [("train", run, 0.0, 10.0, 1, 2), ("resume", run, 20.0, 30.0, 3, 3)]
    text, ok = rehearsal.screen(phases, requests, runs, [], 1024, "m")
    assert ok, text
    assert "| train | 3 |" not in text and "| resume | 3 | m@t-3 |" in text
    text, ok = rehearsal.screen(phases, requests, [("train", run, 0.0, 10.0, 1, 3)], [], 1024, "m")
    assert not ok and "| train | 1-3 | 2 pushed | 3 steps logged | | FAIL |" in text
