"""Data-parallel training: 04 under `accelerate launch` with 2 CPU processes (gloo).

1. A 2-step run of 04's main: both ranks end with the same adapter (this file, run by the launcher, runs 04's
   main on each rank and writes that rank's adapter weight sum), the sum is the saved adapter's, and the
   metrics count every rank's trajectories.
2. One update split over 2 processes equals the same update in one process (token-mean over all
   ranks' tokens, summed gradients): this file run by the launcher is the 2-process side.
"""

import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from conftest import policy_args  # noqa: E402

TINY = ["--max-new-tokens", "6", "--max-turns", "2", "--no-progress"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, timeout=300):
    """`accelerate launch` N=2 processes on this machine's CPUs. (--multi_gpu only picks accelerate's
    torchrun launcher; without CUDA each process runs on the CPU and joins a gloo group.)"""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *map(str, args),
    ]
    e = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
    )
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def test_two_processes_keep_one_adapter_and_log_every_trajectory(tiny_model, tmp_path, trainer):
    out = tmp_path / "runs"
    p = launch(
        [
            Path(__file__),
            "train",
            tmp_path,
            "--model",
            tiny_model,
            "--steps",
            "2",
            "--scenarios-per-step",
            "2",
            "--k",
            "2",
            "--save-every",
            "1",
            "--lr",
            "1e-2",
            "--out-dir",
            out,
            *TINY,
        ]
    )
    assert p.returncode == 0, p.stderr[-3000:]
    runs = [d for d in out.iterdir() if d.is_dir()]
    assert len(runs) == 1, runs  # one run folder: rank 0's
    run = runs[0]
    sums = [json.loads((tmp_path / f"adapter_sum_rank{r}.json").read_text()) for r in (0, 1)]
    assert sums[0] == sums[1]  # both processes ended with the same adapter
    # the sum is that of the adapter rank 0 saved
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    saved = PeftModel.from_pretrained(base, str(run / "adapter"), is_trainable=True)
    trainable = [p for p in saved.parameters() if p.requires_grad]
    assert abs(sum(float(p.detach().double().sum()) for p in trainable) - sums[0]) < 1e-9
    # metrics: each rank rolled out 1 scenario x K=2; the log counts all 4 trajectories of a step
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and len(rollouts) == 8
    for m in metrics:
        mine = [r for r in rollouts if r["step"] == m["step"]]
        assert m["trajectories"] == 4 and len({r["scenario_id"] for r in mine}) == 2
        scored = sum(t["reply_tokens"] for r in mine for t in r["turns"] if not t["judge_failed"])
        assert m["token_passes"] == scored > 0
        assert abs(m["return_mean"] - sum(r["return"] for r in mine) / 4) < 1e-9
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 2
    assert p.stdout.count("step    1 |") == 1  # one log line per step: rank 0's


# ---------------------------------------------------------------------------------------------
# One update, split over 2 processes vs in one process
# ---------------------------------------------------------------------------------------------
def fixed_update(trainer, model_path, share=(0, 1)):
    """Four fixed trajectories of unequal lengths with fixed advantages; the process takes
    trajectories share[0]::share[1], runs one policy_update, and returns the LoRA weights."""
    env = trainer.env

    args = policy_args(
        model_path,
        minibatch_size=64,
        micro_batch_size=1,
        update_epochs=1,
        temperature=1.0,
        kl_coef=0.0,
        tis_cap=0.0,
    )
    torch.manual_seed(0)
    model, tok = common.load_policy(args, trainable=True)
    # plain SGD at lr 1: the LoRA B weights after the step are minus the summed gradient (its norm, ~0.15, is
    # under the clip), so the comparison below checks the gradients themselves. AdamW's first step moves an
    # entry by lr g / (|g| + 1e-8): where the +- advantages cancel a gradient entry to ~1e-8, float32 rounding
    # in the order the 4 gradients are summed (one process vs two) became a 2e-6 weight difference
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    trajs, advs = [], []
    for n, (prompt_len, reply_len, adv) in enumerate([(5, 3, 1.0), (7, 9, -0.5), (4, 2, 0.3), (6, 12, -1.2)]):
        ids = [(7 * n + j) % 500 + 3 for j in range(prompt_len + reply_len)]
        trajs.append(
            env.Trajectory(
                scenario={},
                k=n,
                ids=ids,
                messages=[],
                vs=[[0.0, 0.0, 0.0]],
                spans=[(prompt_len, prompt_len + reply_len)],
                sampler_logprobs=[[-1.0] * reply_len],
            )
        )
        advs.append([adv])
    r, w = share
    out = trainer.policy_update(
        model, tok, opt, sched, trainer.as_samples(trajs[r::w], advs[r::w]), args, Accelerator()
    )
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return weights, out


def test_one_update_over_two_processes_equals_one_process(tiny_model, tmp_path, trainer):
    single, out = fixed_update(trainer, tiny_model)
    p = launch([Path(__file__), tiny_model, tmp_path / "rank0.pt"])
    assert p.returncode == 0, p.stderr[-3000:]
    both = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert set(both["weights"]) == set(single)
    for name, w in single.items():
        torch.testing.assert_close(both["weights"][name], w, rtol=1e-5, atol=1e-6)
    assert both["token_passes"] == out["token_passes"] == 3 + 9 + 2 + 12
    assert abs(both["loss"] - out["loss"]) < 1e-6


def adapter_sum(model) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters() if p.requires_grad)


if __name__ == "__main__":  # the 2-process side of the tests above, started by accelerate launch
    trainer = importlib.import_module("04_mica_train")
    if sys.argv[1] == "train":  # 04's main on this rank; then this rank's adapter weight sum
        out, loop, trained = Path(sys.argv[2]), trainer.train_loop, []

        def train_loop(run, start):
            loop(run, start)
            trained.append(run.model)

        trainer.train_loop = train_loop
        trainer.main(sys.argv[3:])
        rank = int(os.environ["RANK"])
        (out / f"adapter_sum_rank{rank}.json").write_text(json.dumps(adapter_sum(trained[0])))
    else:
        acc = Accelerator(cpu=not torch.cuda.is_available())  # joins the launcher's processes as 04's main does
        weights, out = fixed_update(trainer, sys.argv[1], share=(acc.process_index, acc.num_processes))
        if acc.is_main_process:
            torch.save({"weights": weights, "token_passes": out["token_passes"], "loss": out["loss"]}, sys.argv[2])
        acc.end_training()
