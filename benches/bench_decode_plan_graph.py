"""What a decode captured with a `DecodePlan` costs against the split heuristic, piece by piece.

A captured plan launches a fixed grid (`capacity × kv_heads` programs; those past the item
count exit at once), since the graph cannot know how a later plan splits. This times, as
CUDA-graph replays under do_bench's L2 flush: the heuristic, the plan as captured, the plan
through an older copy of the kernels (`--old`, alternating rounds), and the variants named by
`--configs` (decode config overrides).

Usage (CUDA machine): PYTHONPATH=python python3 benches/bench_decode_plan_graph.py [--old DIR] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import decode_batch, dobench_graph_us  # noqa: E402

from pagedkv import kernels as K  # noqa: E402
from pagedkv.decode_plan import DecodePlan  # noqa: E402

SHAPES = [  # (name, q_heads, kv_heads, head_dim, batch, ctx or None for the ragged batch)
    ("anchor", 32, 8, 128, 64, 4096),
    ("anchor", 32, 8, 128, 1, 32768),
    ("anchor", 32, 8, 128, 8, 8192),
    ("hd 64", 32, 8, 64, 64, 4096),
    ("GQA 32/4", 32, 4, 128, 64, 4096),
    ("ragged", 32, 8, 128, 128, None),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--old", default=None, metavar="DIR",
                    help="an older copy of the kernels package (gpu_kernel_safety.sh --prepare)")
    ap.add_argument("--configs", default="[]",
                    help="JSON object or list of objects: decode config overrides to time")
    args = ap.parse_args(argv)
    cfgs = json.loads(args.configs)
    cfgs = cfgs if isinstance(cfgs, list) else [cfgs]
    rows = []
    old = None
    if args.old:
        from bench_kernels import load_old_kernels

        old = load_old_kernels(args.old)
    for name, qh, kh, hd, batch, ctx in SHAPES:
        lens, sets, sl = decode_batch(batch, ctx, q_heads=qh, kv_heads=kh, hd=hd)
        q, kc, vc, bt = sets[0]
        out = torch.empty_like(q)
        ws = K.DecodeWorkspace(batch, qh, kh, hd, device="cuda")
        plan = DecodePlan(batch, qh, kh, hd, device="cuda")
        plan.update(lens)
        torch.cuda.synchronize()
        r = {"shape": name, "batch": batch, "ctx": ctx, "head_dim": hd, "kv_heads": kh,
             "items": plan.num_items, "capacity": plan.capacity, "chunk": plan.chunk}
        r["heuristic"] = dobench_graph_us(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws))
        ref = out.clone()
        r["plan"] = dobench_graph_us(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan))
        r["plan_err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        if old is not None:
            # The same call through the older kernels, alternating with the current ones.
            oplan = old.DecodePlan(batch, qh, kh, hd, device="cuda")
            oplan.update(lens)
            for rnd in range(2):
                r[f"old_plan_{rnd}"] = dobench_graph_us(lambda: old.paged_decode(q, kc, vc, bt, sl, out=out,
                                                                    plan=oplan))
                r[f"plan_{rnd}"] = dobench_graph_us(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out,
                                                              plan=plan))
            r["old_plan"] = min(r["old_plan_0"], r["old_plan_1"])
            r["plan"] = min(r["plan_0"], r["plan_1"], r["plan"])
        for cfg in cfgs:
            key = "plan " + json.dumps(cfg, sort_keys=True)
            r[key] = dobench_graph_us(lambda cfg=cfg: K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan,
                                                        config=cfg))
            r[key + " err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        rows.append(r)
        print(f"{name:9s} b={batch:4d} ctx={ctx}: items {plan.num_items}/{plan.capacity} chunk "
              f"{plan.chunk} | heuristic {r['heuristic']:7.1f} | plan {r['plan']:7.1f} | old plan "
              f"{r.get('old_plan', float('nan')):7.1f} | " + " | ".join(
                  f"{k[5:]} {r[k]:7.1f}" for k in r if k.startswith("plan {") and
                  not k.endswith("err")), flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
