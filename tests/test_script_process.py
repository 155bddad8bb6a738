"""run_script's forked runs (tests/script_process.py) behave as a fresh interpreter would: the same output,
exit code, argv, working folder, environment and sys.path[0], this project's modules imported fresh each run,
an uncaught exception's traceback and exit 1, and a run past its timeout killed."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, run_script

SCRIPT = textwrap.dedent(
    """
    import os, sys
    print("argv", sys.argv[1:])
    print("cwd", os.getcwd())
    print("var", os.environ.get("SCRIPT_PROCESS_TEST"))
    print("path0", sys.path[0])
    print("common imported before", "common" in sys.modules)
    sys.path.insert(0, sys.argv[1])
    import common
    print("warned before", sorted(common._warned))
    common.warn("once per process")
    if sys.argv[2] == "raise":
        raise ValueError("a bug")
    sys.exit(int(sys.argv[2]))
    """
)


def test_a_forked_run_prints_and_exits_as_a_fresh_interpreter(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    extra = {"SCRIPT_PROCESS_TEST": "42"}
    forked = run_script(script, ROOT, 3, cwd=work, env_extra=extra)
    fresh = subprocess.run(
        [sys.executable, str(script), str(ROOT), "3"],
        cwd=work,
        env={**os.environ, **extra},
        capture_output=True,
        text=True,
    )
    assert forked.returncode == fresh.returncode == 3
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr == "warning: once per process\n"
    assert f"argv ['{ROOT}', '3']" in forked.stdout and f"cwd {work}" in forked.stdout
    assert "var 42" in forked.stdout and f"path0 {tmp_path}" in forked.stdout
    # a second run starts from nothing: the module and its warned-once set are new
    again = run_script(script, ROOT, 0, cwd=work)
    assert again.returncode == 0 and "common imported before False" in again.stdout
    assert "warned before []" in again.stdout and again.stderr == "warning: once per process\n"
    assert "var None" in again.stdout


def test_a_forked_run_that_raises_shows_the_traceback_and_exits_1(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    p = run_script(script, ROOT, "raise")
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1] == "ValueError: a bug" and "Traceback (most recent call last)" in p.stderr


def test_a_forked_run_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_script(script, timeout=5)
    assert e.value.output == "started\n"
