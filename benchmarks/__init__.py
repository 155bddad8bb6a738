"""benchmarks/: one file per external benchmark (eqbench3.py, sage.py, emobench.py), each its loader, protocol
and scorer; 05_eval.py runs them by --suite. Support modules: they import common.py and this package (the
rule below, which labels an official checkout the same way for all three), never a stage (05 hands them what
they need).

  checkout(folder, files, outer)   the commit of the official checkout at folder, and whether a file the
                                   protocol reads differs from it; None when there is no such checkout
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def checkout(folder, files, outer: bool = False) -> tuple[str, bool] | None:
    """(`git -C folder rev-parse HEAD`, whether `git status --porcelain -- files` lists any: changed, staged or
    deleted) for the official checkout at folder; files: what the protocol reads, relative to folder. None when
    there is no such checkout: folder must be its repository's top (outer: or the folder right below the top,
    as SAGE's folder in Tencent/digitalhuman), and the repository must track every one of the files. So a copy
    dropped into some other git project, or committed deeper inside one (this project's test fixtures), never
    takes that project's commit; and a protocol file left untracked means None (no commit holds it)."""
    folder = Path(folder)

    def git(*argv):
        try:
            out = subprocess.run(["git", "-C", str(folder), *argv], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top, head = git("rev-parse", "--show-toplevel"), git("rev-parse", "HEAD")
    tops = {folder.resolve(), folder.resolve().parent} if outer else {folder.resolve()}
    if top is None or head is None or Path(top).resolve() not in tops:
        return None
    if git("ls-files", "--error-unmatch", "--", *files) is None:  # an untracked protocol file: no commit holds it
        return None
    changed = git("status", "--porcelain", "--", *files)
    return head, changed is None or changed != ""
