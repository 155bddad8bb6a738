"""The process conftest.run_script runs a stage script in: a fork of multiprocessing's fork server, which has
imported the libraries every stage imports once (torch, transformers, peft, accelerate: about 6 s of each
script's start on 2 cores, most of the suite's time when every run paid it). The run is still its own
process: the script runs as __main__ with its own argv, environment, working directory and sys.path, its
stdout and stderr go to files, its exit code is the process's, and this project's modules are imported fresh
by each run (none is preloaded), so nothing passes from one run to the next.

A variable the libraries read when they are imported (HF_*, TRANSFORMERS_*) cannot change in a fork: the
server has the tests' (conftest.py sets them, offline), and run_script starts a fresh interpreter for a run
that sets another."""

import atexit
import os
import runpy
import sys
import traceback

# what the fork server imports once (multiprocessing's preload): what every stage script imports
PRELOAD = [
    "torch",
    "accelerate",
    "peft",
    "transformers.trainer_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    __name__,
]
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")


def run(script: str, args: list[str], env: dict, cwd: str, out_path: str, err_path: str):
    """In the forked child: `python script *args` as the command line would run it, then exit with its code."""
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # OpenMP read it when torch was loaded, in the server: set it as it asks
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.argv = [script, *args]
    # the script's folder first, then the interpreter's own paths (not the tests' or the repository's)
    sys.path[:] = [os.path.dirname(script)] + [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix))]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # as the interpreter exits: None is 0, a message is printed and exits 1
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
