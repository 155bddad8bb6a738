"""options.py: every stage's options as dataclasses, and the command line built from them.

  option            a dataclass field that is also a flag: its default, one line of help, argparse's extras
  number            a checking type: a bad value exits 2 with one line naming the flag
  options_parser    argparse from (title, dataclass) groups, with --config FILE.yaml; ArgumentParser, add_options
                    (called from one other file: scripts/label_rubrics.py)
  parse_options     the defaults, under a preset's values, under --config's file (read_config: also runs.py's),
                    under the flags
  ModelOptions      the policy's flags, which every stage takes (common.load_policy reads them)
A support module: it imports common.py (its one-line errors), never a stage; runs.parse_with_preset adds the
preset a training stage starts from.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from pathlib import Path

import common


def option(default, help: str, **flag):
    """A dataclass field that is also a command-line flag, --its-name-with-dashes: its default, one line of help,
    and what argparse needs beyond them (type: a checking type such as number(int, low=1); choices; nargs). A
    bool field is a switch: --name when its default is False, --no-name when it is True."""
    metadata = {"help": help, **flag}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def number(kind=float, low=None, high=None, above=None):
    """An argparse type: a `kind` number in [low, high] and > above (each bound optional), else argparse's own
    one-line error naming the flag ("argument --k: must be >= 1, got 0"), exit code 2."""

    def parse(text):
        x = kind(text)
        for ok, rule in (
            (low is None or x >= low, f">= {low}"),
            (high is None or x <= high, f"<= {high}"),
            (above is None or x > above, f"> {above}"),
        ):
            if not ok:
                raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return x

    parse.__name__ = kind.__name__  # argparse's message for a non-number: "invalid int value: 'x'"
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """argparse, its errors one line naming the flag ("error: argument --k: must be >= 1, got 0"), exit code 2
    (through run_main), not a usage block. `fields` maps each option's name to its flag's action."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields = {}

    def error(self, message):
        raise common.UserError(message)


def add_options(parser: ArgumentParser, title: str, options: type):
    """One flag per field of the dataclass `options`, in a group of --help titled `title`."""
    g = parser.add_argument_group(title)
    for f in dataclasses.fields(options):
        flag, kwargs = "--" + f.name.replace("_", "-"), dict(f.metadata)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if default is True:
            action = g.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", **kwargs)
        elif default is False:
            action = g.add_argument(flag, dest=f.name, action="store_true", **kwargs)
        else:
            kwargs.setdefault("type", str if default is None else type(default))
            action = g.add_argument(flag, dest=f.name, default=default, **kwargs)
        parser.fields[f.name] = action


def options_parser(description: str, groups: list[tuple[str, type]]) -> ArgumentParser:
    """argparse built from dataclasses: each (title, dataclass) of `groups` a group of flags, in this order in
    --help, and --config. (transformers' HfArgumentParser builds the same from dataclasses, but takes each flag's
    type from its annotation, dropping the checking types that give one line and exit 2, and lists every flag
    twice, --max_turns and --max-turns.)"""
    p = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="a YAML file of options (name: value, the names with underscores, e.g. max_turns: 8); flags given win",
    )
    for title, options in groups:
        add_options(p, title, options)
    return p


def read_config(path, parser: ArgumentParser) -> dict:
    """A YAML file of options -> {name: value}, each value checked as its flag's would be: an unknown name, or a
    value the flag's type or choices refuse, stops with one line naming the file and the option."""
    import yaml

    common.check(os.path.isfile(path), f"--config {path}: no such file")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise common.UserError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    data = {} if data is None else data
    common.check(isinstance(data, dict), f"{path}: expected lines of name: value, got {type(data).__name__}")
    out = {}
    for name, value in data.items():
        action = parser.fields.get(name)
        common.check(
            action is not None, f"{path}: unknown option '{name}' (--help lists them; write max_turns, not --max-turns)"
        )
        where = f"{path}: {name}"
        if action.nargs == 0:  # a switch
            common.check(isinstance(value, bool), f"{where}: must be true or false, got {value!r}")
        elif value is not None or action.default is not None:
            many = action.nargs not in (None, "?")
            common.check(not many or isinstance(value, list), f"{where}: must be a list, got {value!r}")
            common.check(
                not isinstance(action.nargs, int) or len(value) == action.nargs,
                f"{where}: must hold {action.nargs} values, got {value!r}",
            )
            try:
                value = [action.type(str(x)) for x in value] if many else action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                raise common.UserError(f"{where}: {e or 'bad value'} ({value!r})") from None
            choices = action.choices or [value]
            common.check(value in choices, f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        out[name] = value
    return out


def parse_options(parser: ArgumentParser, argv=None, base: dict | None = None) -> argparse.Namespace:
    """The options: each field's default, under `base` (a preset's values), under --config's file, under the
    flags given on the command line."""
    config = parser.parse_known_args(argv)[0].config
    parser.set_defaults(**(base or {}))
    parser.set_defaults(**(read_config(config, parser) if config else {}))
    return parser.parse_args(argv)


@dataclasses.dataclass
class ModelOptions:
    """The policy: which model, its adapter, how it loads (every stage)."""

    model: str = option(
        common.PACKAGED_SMOLLM2,
        "hub id, local folder, alias (e.g. Qwen2.5-7B-Instruct) or the packaged offline default "
        f"{common.PACKAGED_SMOLLM2}",
    )
    adapter: str | None = option(None, "start from this peft LoRA adapter folder")
    lora_targets: str = option(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "comma-separated module names that get LoRA"
    )
    load_in_4bit: str = option(
        "auto",
        "4-bit NF4 base weights (bitsandbytes); auto = on with CUDA, off on a CPU and with --engine (the learner "
        "then scores the engine's bf16 weights: docs/scale.md)",
        choices=["auto", "on", "off"],
    )
    gradient_checkpointing: bool = option(
        False, "recompute activations in the backward pass (less memory, ~30%% slower)"
    )
    trust_remote_code: bool = option(False, "let a hub model run its own Python code")
