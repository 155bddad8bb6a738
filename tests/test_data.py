"""The shipped data files are valid and balanced as the README says."""

import subprocess
import sys

from conftest import ROOT


def test_care_data_passes_its_checks():
    p = subprocess.run([sys.executable, str(ROOT / "data" / "check_care_data.py")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "OK: all checks passed" in p.stdout
    assert "train  lines 147" in p.stdout and "pairs 120" in p.stdout and "pairs  40" in p.stdout
