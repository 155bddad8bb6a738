"""benchmarks/: one file per external benchmark (eqbench3.py, sage.py, emobench.py), each its loader, protocol
and scorer; 05_eval.py runs them by --suite. Support modules: they import common.py and never a stage (05
hands them what they need)."""
