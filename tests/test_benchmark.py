"""experiments/benchmark.py runs end to end (--quick, tiny model) and writes its table."""
import json

from conftest import run_script


def test_benchmark_quick_writes_the_table(tiny_model, tmp_path):
    p = run_script("experiments/benchmark.py", "--model", tiny_model, "--quick", "--out-dir", tmp_path,
                   env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "benchmark.md").read_text()
    for figure in ("1. rollout", "2. update", "3. peer", "4. memory", "QLoRA estimate", "torch 2.", "Command:"):
        assert figure in md, figure
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [r["figure"][:2] for r in rows] == ["1.", "2.", "3.", "4."]
    assert rows[0]["ratio"] > 0 and rows[1]["ratio"] > 0
    assert "NOT equal work" not in rows[0]["note"]                  # both loops generated the same tokens
    assert rows[2]["ratio"] is None or rows[2]["ratio"] > 0         # None: trl not installed, said so
