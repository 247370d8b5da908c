"""Two builds of pagedkv in one process, the serving trace (bench_manager.bench_serve) alternated.

Run:  .venv/bin/python benches/compare_serve.py OLD_PYTHON_DIR NEW_PYTHON_DIR [rounds]

Each *_PYTHON_DIR holds a `pagedkv/` package with its own `_core.abi3.so` (e.g. a copy of
`python/` with main's extension, and this tree's `python/`).
Each round runs benches/bench_manager.py's bench_serve (11 batches) on each build in turn;
prints the median over rounds of each case's median.
"""
import importlib.util, sys, statistics
def load_pkg(parent, name):
    spec = importlib.util.spec_from_file_location(name, f"{parent}/pagedkv/__init__.py",
                                                  submodule_search_locations=[f"{parent}/pagedkv"])
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
old = load_pkg(sys.argv[1], "pagedkv_old"); new = load_pkg(sys.argv[2], "pagedkv")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
import os
spec = importlib.util.spec_from_file_location(
    "bm", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_manager.py"))
bm = importlib.util.module_from_spec(spec); spec.loader.exec_module(bm)
res = {"old": {}, "new": {}}
for r in range(rounds):
    for tag, pkg in (("old", old), ("new", new)):
        bm.BlockManager, bm.StepBuffers = pkg.BlockManager, pkg.StepBuffers
        for row in bm.bench_serve(11):
            res[tag].setdefault(row["name"], []).append(row["median_us"])
for name in res["old"]:
    o, n = statistics.median(res["old"][name]), statistics.median(res["new"][name])
    print(f"{name:30s} old {o:6.2f} us  new {n:6.2f} us  ({(n - o) / o * 100:+.0f}%)  rounds {rounds}")
