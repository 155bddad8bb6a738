"""runs.py: a run's files, in one place: every stage's run folder, its JSONL files, the checkpoint, the step log.

  read_jsonl, text_lines      input JSONL / text, every error one line naming file:line (and the field)
  append_jsonl                append-only logs (metrics.jsonl, rollouts.jsonl, cases.jsonl): one write,
                              flushed and fsynced, so a kill tears at most the last line; repair_jsonl_tail
                              cuts such a line on --resume
  atomic_write                a file whole or not at all (args.json, results.json)
  parse_with_preset           a training stage's options: the preset's file, --config's, the flags given
  RunOptions, open_run        --seed, --out-dir, --run-name, --no-progress; the run folder and its args.json
                              (the API key redacted: public_args); flags_given and header_line, a training
                              run's header
  save_checkpoint, load_checkpoint, checkpoint_on_error
                              <run>/checkpoint.pt: torch.save of the adapter (peft's state dict), the
                              optimizer and the schedule, renamed over the last (kill -9 safe)
  PhaseTimer, step_metrics    a training step's seconds by phase, and its metrics line from its records
  MetricsLogger               a step's line on the console, in metrics.jsonl and, with --report-to, in
                              accelerate's tracker
  StepLog                     04's step record: the dialogues to rollouts.jsonl and the metrics line, gathered
                              from every process
  UpdateStats                 04's update statistics: one call per micro-batch, one per optimizer step, the
                              sums over the processes at the end

A support module: it imports common.py, options.py (RunOptions, the preset) and parallel.py (the sums over the
processes), never a stage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import common
import options
import parallel


def text_lines(path):
    """(line number, text) of a UTF-8 file ("\\r\\n" or "\\n", a byte-order mark dropped); a line that is not
    UTF-8 is one error naming file:line."""
    common.check(os.path.isfile(path), f"{path}: no such file")
    raw = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n")
    for lineno, b in enumerate(raw[:-1] if raw[-1] == b"" else raw, 1):
        try:
            yield lineno, b.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise common.UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1})") from None


def read_jsonl(path, fields: dict | None = None, optional: dict | None = None, unique=()) -> list[dict]:
    """Every line a JSON object with `fields` (name -> type or tuple of types) and, when present, the
    `optional` ones; the `unique` fields together never repeat. An error names file:line and field, e.g.
    "data/x.jsonl:7: field 'opening' must be str". Each record gets `_where` = "file:line"."""
    records, first = [], {}
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:  # json's message may end in "at": say it once
            raise common.UserError(
                f"{path}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
            ) from None
        common.check(isinstance(rec, dict), f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        for name, typ in {**(fields or {}), **{k: t for k, t in (optional or {}).items() if k in rec}}.items():
            common.check(name in rec, f"{path}:{lineno}: missing field '{name}'")
            types = typ if isinstance(typ, tuple) else (typ,)
            ok = isinstance(rec[name], types) and not (isinstance(rec[name], bool) and bool not in types)
            common.check(
                ok,
                f"{path}:{lineno}: field '{name}' must be {' or '.join(t.__name__ for t in types)}, "
                f"got {type(rec[name]).__name__}",
            )
        if unique:
            key = tuple(str(rec[k]) for k in unique)
            common.check(
                key not in first,
                f"{path}:{lineno}: {', '.join(unique)} {'/'.join(key)!r} again (first on line {first.get(key)})",
            )
            first[key] = lineno
        records.append({**rec, "_where": f"{path}:{lineno}"})
    common.check(records, f"{path}: no records")
    return records


def append_jsonl(path, records):
    """Append records as lines in one write, flushed and fsynced: a kill tears at most the last line."""
    text = "".join(
        json.dumps({k: v for k, v in r.items() if k != "_where"}, ensure_ascii=False) + "\n"
        for r in ([records] if isinstance(records, dict) else records)
    )
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def repair_jsonl_tail(path) -> int:
    """Cut a torn last line (a process killed mid-append) off an append-only JSONL file; the bytes cut."""
    data = Path(path).read_bytes() if Path(path).exists() else b""
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(path, "rb+") as f:
        f.truncate(keep)
    common.warn(f"{path}: removed a torn last line ({len(data) - keep} bytes) left by an interrupted run")
    return len(data) - keep


def atomic_write(path: Path, text: str):
    """A file whole or not at all: a temporary file, fsynced, then renamed over the target."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def public_args(args) -> dict:
    """The args as a dict with the API key redacted: what is printed and saved."""
    return {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()}


@dataclasses.dataclass
class RunOptions:
    """The run: its seed, its folder, its progress bars (every stage; each sets its own run_name)."""

    seed: int = options.option(
        0, "random seed (sampling, data order, the scripted user)", type=options.number(int, low=0, high=2**32 - 1)
    )
    out_dir: str = options.option("runs", "each run writes into its own folder under this")
    run_name: str = options.option("run", "prefix of the run folder")
    progress: bool = options.option(True, "show progress bars (--no-progress hides them, transformers' too)")


def flags_given(parser: argparse.ArgumentParser, args) -> dict:
    """The flags whose value differs from the parser's default (the preset's, where one is set), as the run's
    header line shows them; --resume and the API key left out."""
    defaults = vars(parser.parse_args([]))
    return {
        k: v
        for k, v in public_args(args).items()
        if k in defaults and v != defaults[k] and k not in ("resume", "api_key")
    }


def parse_with_preset(parser, argv, presets: Path) -> argparse.Namespace:
    """A training stage's options: the field defaults, under the preset's YAML file (--preset NAME in `presets`;
    auto, or a --config file's preset: gpu with CUDA, else cpu), under --config's file, under the flags given.
    args.preset_note says which preset and why (the header line prints it); args.flags_given, the flags given."""
    first = parser.parse_known_args(argv)[0]
    config = options.read_config(first.config, parser) if first.config else {}
    name = first.preset if first.preset != "auto" else config.get("preset", "auto")
    cuda = common.pick_device().type == "cuda"
    why = "auto: CUDA found" if cuda else "auto: no CUDA"
    why = "asked" if first.preset != "auto" else "from --config" if name != "auto" else why
    name = name if name != "auto" else "gpu" if cuda else "cpu"
    args = options.parse_options(parser, argv, base=options.read_config(presets / f"{name}.yaml", parser))
    args.preset_note = f"preset presets/{name}.yaml ({why})" + (f" | config {first.config}" if first.config else "")
    args.flags_given = flags_given(parser, args)
    return args


def open_run(args, logs=()) -> Path:
    """A new folder <out_dir>/<run_name>-<time>[-n] holding args.json (nothing earlier is overwritten); or
    with --resume that folder: checked, changed flags warned about, a torn last line of its `logs` cut."""
    if getattr(args, "resume", None):
        run_dir = Path(args.resume)
        common.check((run_dir / "args.json").exists(), f"--resume {run_dir}: not a run folder (no args.json)")
        saved = json.loads((run_dir / "args.json").read_text())
        for k, v in public_args(args).items():
            if k not in ("resume", "out_dir", "run_name", "flags_given", "preset_note") and json.dumps(
                saved.get(k), default=str
            ) != json.dumps(v, default=str):
                print(f"warning: --resume with {k} = {v!r}; the run started with {saved.get(k)!r}", file=sys.stderr)
        for name in logs:
            repair_jsonl_tail(run_dir / name)
        return run_dir
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        run_dir = Path(args.out_dir) / (f"{args.run_name}-{stamp}" + (f"-{n}" if n else ""))
        with contextlib.suppress(FileExistsError):
            run_dir.mkdir(parents=True)
            atomic_write(run_dir / "args.json", json.dumps(public_args(args), indent=2, default=str))
            return run_dir
    raise common.UserError(f"could not create a run folder under {args.out_dir}")


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, extra=None):
    """<run>/checkpoint.pt: what --resume needs (the adapter's weights, the optimizer, the schedule, the step and
    `extra`), one torch.save to a temporary file renamed over the last: a kill leaves the old one or the new
    one, never half of one. No RNG state: each stage draws from its seed and the step (01: and the epoch)."""
    from peft import get_peft_model_state_dict

    tmp = Path(run_dir) / ".checkpoint.pt.tmp"
    torch.save(
        {
            "step": step,
            "adapter": get_peft_model_state_dict(model),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            **(extra or {}),
        },
        tmp,
    )
    os.replace(tmp, Path(run_dir) / "checkpoint.pt")


def load_checkpoint(run_dir: Path, model, optimizer, scheduler) -> dict | None:
    """Restore <run>/checkpoint.pt into the model, optimizer and schedule; its dict, or None when there is none."""
    from peft import set_peft_model_state_dict

    path = Path(run_dir) / "checkpoint.pt"
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True, map_location="cpu")
    set_peft_model_state_dict(model, state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    # the lr is this run's schedule at the restored step: a resumed run given more --steps stretches the
    # schedule, and the saved lr may be the old schedule's end (0)
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    return state


class MetricsLogger:
    """log(step, metrics): one line to stdout, one JSON line to <run>/metrics.jsonl (append-only) and, with
    --report-to, the same to accelerate's tracker (tensorboard: <run>/tensorboard/), which also gets the run's
    configuration (`config`) at the start. finish() closes the tracker."""

    def __init__(self, run_dir: Path, report_to="none", config=None):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        self.path, self.last_step, self.tracker = Path(run_dir) / "metrics.jsonl", None, None
        if report_to != "none":
            tracker_class = LOGGER_TYPE_TO_CLASS[report_to]
            if tracker_class.requires_logging_directory:
                self.tracker = tracker_class(report_to, Path(run_dir))  # tensorboard: <run>/tensorboard/
            else:
                self.tracker = tracker_class("empathy-rl", name=Path(run_dir).name)  # wandb, trackio: a project
            self.tracker.start()
            # the tracker's configuration table takes numbers, strings and booleans: anything else as text
            plain = (int, float, str, bool)
            self.tracker.store_init_configuration(
                {k: v if isinstance(v, plain) else json.dumps(v, default=str) for k, v in (config or {}).items()}
            )

    def log(self, step: int, metrics: dict):
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        tqdm.write(
            f"step {step:4d} | "
            + " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in clean.items())
        )
        append_jsonl(self.path, {"step": step, **clean})
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=step)
        self.last_step = step

    def finish(self):
        if self.tracker is not None:
            self.tracker.finish()


class PhaseTimer:
    """A step's seconds by phase: `with timer("rollout"): ...` adds to seconds["rollout"]; seconds["step"] is
    the time since the timer was made, read when the step is logged."""

    def __init__(self):
        self.start, self.phases = time.time(), {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.time() - t0

    @property
    def seconds(self) -> dict:
        return {**self.phases, "step": time.time() - self.start}


def header_line(args, run_dir, params, accelerator, resumed_at) -> str:
    """A training run's one header line: the folder, the preset (and --config), the flags given that differ
    from those defaults (the whole configuration is in args.json), what judges and how dialogues end where a
    reward changes it, the device, the adapter's size."""
    given = []
    for k, v in args.flags_given.items():
        flag = "--" + k.replace("_", "-")
        given.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {v}")
    weights = getattr(args, "reward_weights", {})
    return (
        f"run folder {run_dir} | {args.preset_note} | flags given: {' '.join(given) or 'none'}"
        + (
            f" | --judge {args.judge} also judges the criteria of --reward care/kardia"
            if {"care", "kardia"} & set(weights)
            else ""
        )
        + (" | dialogues end by RLVER's emotion rule (--min-turns unused)" if args.emotion_ends else "")
        + f" | device {accelerator.device} | trainable parameters {sum(p.numel() for p in params):,}"
        + (f" | data-parallel over {accelerator.num_processes} processes" if accelerator.num_processes > 1 else "")
        + (f" | resumed from {run_dir / 'checkpoint.pt'} at step {resumed_at}" if resumed_at else "")
    )


def step_metrics(records, rewards, counts, stats, lr, seconds, peak_rss_gb) -> dict:
    """A training step's metrics line from its dialogues' records (03's trajectory_record, with the turns'
    reply_tokens and cut_off, and 04's judge_failed), every turn's training reward, the step's counts, the
    update's statistics, the lr the step used and its seconds by phase."""
    turns, n = [turn for rec in records for turn in rec["turns"]], len(records)
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "return_mean": sum(rec["return"] for rec in records) / n,  # sum_t r_t, not discounted
        "success_rate": sum(rec["outcome"] == "success" for rec in records) / n,
        "final_distance": sum(rec["final_distance"] for rec in records) / n,
        "final_emotion": sum(rec["final_emotion"] for rec in records) / n,
        # the pure IDR of a dialogue telescopes to d(P0) - d(P_T): 05's held-out measure
        "distance_drop": sum(rec["initial_distance"] - rec["final_distance"] for rec in records) / n,
        "trajectories": n,
        "turns_mean": len(turns) / n,
        "cut_off_frac": sum(turn["cut_off"] for turn in turns) / max(1, len(turns)),
        "judge_failures": sum(turn["judge_failed"] for turn in turns),
        "user_failures": sum(rec["outcome"] == "user_failed" for rec in records),
        **counts,
        **stats,
        "lr": lr,
        "gen_tokens_per_s": sum(turn["reply_tokens"] for turn in turns) / max(seconds["rollout"], 1e-9),
        "train_tokens_per_s": stats["token_passes"] / max(seconds["update"], 1e-9),
        **{f"{k}_seconds": v for k, v in seconds.items()},
        "peak_rss_gb": peak_rss_gb,
    }


class StepLog:
    """A training step's record (04's), one call a step: every dialogue's record to <run>/rollouts.jsonl, then one
    metrics line (step_metrics, written by the MetricsLogger: the console, metrics.jsonl, --report-to).
    Data-parallel: process 0 gathers every process's share and writes. api_totals() gives the api: backends'
    retries and failures so far; a step logs their increase."""

    def __init__(self, accelerator, run_dir, logger, api_totals):
        self.accelerator, self.dir, self.logger = accelerator, run_dir, logger  # logger: None off process 0
        self.api_totals, self.api_before = api_totals, {}

    def __call__(self, step, records, rewards, counts, stats, lr, timer, own=None):
        """own: this process's values, logged as a list over the processes ({key}_by_process), not summed."""
        api = self.api_totals()
        counts = {**counts, **{k: v - self.api_before.get(k, 0) for k, v in api.items()}}
        self.api_before = api
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        part = {"records": records, "rewards": [x for r in rewards for x in r], "counts": counts, "rss": rss}
        part["own"] = own or {}
        everyone = parallel.gather_over_processes(self.accelerator, {**part, "seconds": timer.seconds})
        if not self.accelerator.is_main_process:
            return  # the other processes go on to the next step
        records = [rec for p in everyone for rec in p["records"]]
        append_jsonl(self.dir / "rollouts.jsonl", records)
        metrics = step_metrics(
            records,
            [x for p in everyone for x in p["rewards"]],  # every turn's training reward, unrounded
            {k: sum(p["counts"][k] for p in everyone) for k in everyone[0]["counts"]},
            stats,
            lr,
            {k: max(p["seconds"][k] for p in everyone) for k in timer.seconds},  # processes run side by side
            max(p["rss"] for p in everyone),  # of the largest process
        )
        metrics.update({f"{k}_by_process": [p["own"][k] for p in everyone] for k in everyone[0]["own"]})
        self.logger.log(step, metrics)


def checkpoint_on_error(run_dir: Path, model, optimizer, scheduler, logger, start: int, extra=None):
    """A training loop stopped on a common.UserError (the judge's endpoint went down, say): the last logged step
    is saved as a checkpoint, so nothing finished is lost, and the way to go on is printed."""
    if logger is not None and logger.last_step is not None and logger.last_step >= start:
        save_checkpoint(run_dir, logger.last_step, model, optimizer, scheduler, extra)
        print(
            f"saved checkpoint step {logger.last_step} before stopping; continue with --resume {run_dir}",
            file=sys.stderr,
        )


class UpdateStats:
    """The update's statistics, kept beside the minibatch loop rather than woven through it: one call per
    micro-batch (micro_batch), one per optimizer step (optimizer_step), then result(): the sums over every
    process (parallel.py). Running sums stay on the device until then: the loss of the steps taken, the token
    passes the clip chose, the KL, the sampler gap |log pi_sampler(y_i) - log pi_old(y_i)| (0 when sampling is
    scoring), the truncated importance weights and the tokens their cap cut (both of the first epoch only: the
    same every epoch), the ratio's range, the gradient norms."""

    def __init__(self, device):
        self.device = device
        self.loss_total, self.clip_count, self.kl_total, self.gap_total, self.w_total, self.w_capped = (
            torch.zeros((), dtype=torch.float64, device=device) for _ in range(6)
        )
        self.ratio_lo, self.ratio_hi = torch.tensor(math.inf, device=device), torch.tensor(-math.inf, device=device)
        self.gap_max = torch.zeros((), device=device)
        self.token_passes, self.grad_norms, self.nonfinite_grads = 0, [], 0
        self.minibatch_loss = None

    def minibatch(self):
        """A minibatch starts: its loss, (1/N) sum over its micro-batches, counts if its step is taken."""
        self.minibatch_loss = torch.zeros((), dtype=torch.float64, device=self.device)

    def micro_batch(self, epoch, loss_sum, N, was_clipped, ratio, logp_old, logp_sampler, kl=None, w=None, capped=None):
        if epoch == 0:
            gap = (logp_sampler - logp_old).abs()
            self.gap_total += gap.sum()
            self.gap_max = torch.maximum(self.gap_max, gap.max())
            if w is not None:
                self.w_total += w.sum()
                self.w_capped += capped.sum()
        if kl is not None:
            self.kl_total += kl.detach().sum()
        self.minibatch_loss += loss_sum.detach().double() / N
        self.clip_count += was_clipped.sum()
        self.ratio_lo = torch.minimum(self.ratio_lo, ratio.min())
        self.ratio_hi = torch.maximum(self.ratio_hi, ratio.max())
        self.token_passes += len(ratio)

    def optimizer_step(self, grad_norm: float):
        """After the gradient's clip: a finite norm was a step taken, a non-finite one a step skipped."""
        if math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
            self.loss_total += self.minibatch_loss
        else:
            self.nonfinite_grads += 1

    def result(self, accelerator, update_epochs: int, kl_logged: bool, tis: bool) -> dict:
        """The statistics over every process; the loss is the mean over the optimizer steps taken."""
        sums = torch.stack(
            [
                self.loss_total,
                self.clip_count.double(),
                self.kl_total,
                self.gap_total,
                self.w_total,
                self.w_capped,
                torch.tensor(float(self.token_passes), dtype=torch.float64, device=self.device),
            ]
        )
        loss_total, clip_count, kl_total, gap_total, w_total, w_capped, token_passes = parallel.sum_over_processes(
            accelerator, [sums]
        )[0].tolist()
        own = (float(self.gap_total), float(self.w_total), self.token_passes / update_epochs)  # this process's
        extremes = parallel.gather_over_processes(
            accelerator, (float(self.ratio_lo), float(self.ratio_hi), float(self.gap_max), own)
        )
        steps, scored = len(self.grad_norms), token_passes / update_epochs  # each scored token once, in epoch 0
        # data-parallel: each process's own gap and weights (a process sampling another policy shows here)
        by_process = {}
        if accelerator.num_processes > 1:
            by_process["sampler_gap_mean_by_process"] = [g / n if n else math.nan for *_, (g, _, n) in extremes]
            if tis:
                by_process["tis_weight_mean_by_process"] = [w / n if n else math.nan for *_, (_, w, n) in extremes]
        return {
            "loss": loss_total / steps if steps else math.nan,
            "clip_frac": clip_count / token_passes if token_passes else math.nan,
            "ratio_min": min(lo for lo, *_ in extremes) if token_passes else math.nan,
            "ratio_max": max(hi for _, hi, *_ in extremes) if token_passes else math.nan,
            "kl": kl_total / token_passes if kl_logged and token_passes else math.nan,
            "grad_norm": sum(self.grad_norms) / steps if steps else math.nan,
            "sampler_gap_mean": gap_total / scored if token_passes else math.nan,
            "sampler_gap_max": max(gap for _, _, gap, _ in extremes) if token_passes else math.nan,
            "token_passes": int(token_passes),  # the scored tokens times --update-epochs
            "optimizer_steps": steps,
            "nonfinite_grads": self.nonfinite_grads,
            # with --tis-cap: the importance weights' mean and the share of tokens the cap cut
            **({"tis_weight_mean": w_total / scored, "tis_capped": w_capped / scored} if tis and token_passes else {}),
            **by_process,
        }
