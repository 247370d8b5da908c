"""Side by side in one process: token-id list conversion of two builds of the extension.

Run:  .venv/bin/python benches/compare_list_conversion.py OLD_CORE.so NEW_CORE.so

Admits and frees a 4096-token prompt (prefix caching off) as a Python list and as a uint32 array
(read in place) with each build, alternating; the difference over 4096 is the per-token cost of
converting the list. Medians of 15 runs of 1000 calls.
"""
import importlib.util, sys, time, gc, numpy as np
gc.disable()
def load(path):
    spec = importlib.util.spec_from_file_location("_core", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod
old = load(sys.argv[1]); new = load(sys.argv[2])
arr = np.random.default_rng(3).integers(0, 32000, 4096, dtype=np.uint32); lst = arr.tolist()
def t(m, x, n=1000):
    r=[]
    for _ in range(15):
        t0=time.perf_counter_ns()
        for _ in range(n): m.admit(1,x); m.free(1)
        r.append((time.perf_counter_ns()-t0)/n)
    r.sort(); return r[len(r)//2]
for name, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
    m = mod.BlockManager(4*4096//16+64, 16, None, None, False, False)
    b=t(m,arr); l=t(m,lst)
    print(f"{name:11s} list {l/1e3:7.2f} us  uint32 {b/1e3:6.2f} us  list conversion {(l-b)/4096:6.2f} ns/token")
