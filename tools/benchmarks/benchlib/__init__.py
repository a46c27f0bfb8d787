"""What the benchmarks share and the library does not need: the benchmark data (``data``: real photos,
prepared) and the baseline loader mmfast is measured against (``baseline``). Imported by tools/bench_*.py
(run as scripts, with tools/ first on sys.path: ``from benchlib.data import ...``) and by tests
(``from tools.benchmarks.benchlib.data import ...``)."""
