"""GPU benchmark: a sliding-window layer's paged decode against full attention, by context.

Times `paged_decode` with `window` W (and, for gpt-oss, attention sinks) at contexts of 4K, 32K
and 128K tokens against the same call without a window. The kernels skip the keys before the
window, so a sliding layer's step should stay flat as the context grows while full attention
grows linearly. As the block manager leaves them, the table entries wholly before each window
are -1 in the sliding arms (a kernel that read them would return zeros: the output is checked
against a dense window computed with PyTorch first).

Each figure is the median of CUDA-graph replays over a rotation of three input copies (so the L2
cannot serve one call's K/V to the next), with the split count from the kernel's own heuristic
(`max_seq_len` = the context). Prints a table and writes JSON (`--json PATH`).

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=python python benches/bench_kernels_local.py [--json out.json] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from pagedkv import kernels as K

from bench_kernels import graph_time_us  # noqa: E402  (benches/ is the script's directory)

DT = torch.bfloat16
CONTEXTS = (4096, 32768, 131072)
#: (label, q_heads, kv_heads, head_dim, window, sinks): gpt-oss-120b's sliding layers (128
#: tokens, sinks) and Gemma 3-like 1024-token ones at a Llama-like head layout.
SHAPES = (
    ("gpt-oss (64/8 x 64)", 64, 8, 64, 128, True),
    ("W=1024 (32/8 x 128)", 32, 8, 128, 1024, False),
)


def graph_us(fns):
    """Median per-call time (µs) of the rotation `fns`, replayed as one CUDA graph (the kernel
    bench's timer: 30 replays of 4 rounds of a 3-copy rotation)."""
    return graph_time_us(fns, inner=4, reps=30)


def make_copy(batch, ctx, q_heads, kv_heads, hd, bs, window, seed):
    """One input copy: q, the pools, a full table and a windowed one (-1 before the window)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nblk = -(-ctx // bs)
    num_blocks = batch * nblk
    kc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    vc = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=DT, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    bt = perm.view(batch, nblk).contiguous()
    bt_win = bt.clone()
    first_blk = max(0, ctx - window) // bs
    bt_win[:, :first_blk] = -1
    q = torch.randn(batch, q_heads, hd, device="cuda", dtype=DT, generator=gen)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, bt_win, sl


def check_window(q, kc, vc, bt, sl, window, sinks, out):
    """The windowed output against dense PyTorch on the last `window` keys of sequence 0."""
    ctx = int(sl[0])
    bs = kc.shape[1]
    lo = max(0, ctx - window)
    pos = torch.arange(lo, ctx, device="cuda")
    blk = bt[0, pos // bs].long()
    k = kc[blk, pos % bs].float()
    v = vc[blk, pos % bs].float()
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q[0].float(), k) / q.shape[-1] ** 0.5
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None]], 1)
        p = torch.softmax(s, 1)[:, :-1]
    else:
        p = torch.softmax(s, 1)
    ref = torch.einsum("hl,lhd->hd", p, v)
    err = ((out[0].float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"windowed decode differs from the dense window: rel err {err}"


def bench(batches, contexts, shapes, bs=16):
    rows = []
    for label, qh, kvh, hd, window, use_sinks in shapes:
        for batch in batches:
            for ctx in contexts:
                copies = [make_copy(batch, ctx, qh, kvh, hd, bs, window, seed=i)
                          for i in range(3)]
                sinks = (torch.randn(qh, device="cuda") if use_sinks else None)
                ws = K.DecodeWorkspace(batch, qh, kvh, hd, device="cuda")
                outs = [torch.empty_like(c[0]) for c in copies]

                def full(c, o):
                    return lambda: K.paged_decode(c[0], c[1], c[2], c[3], c[5], out=o,
                                                  workspace=ws, max_seq_len=ctx, sinks=sinks)

                def slide(c, o):
                    return lambda: K.paged_decode(c[0], c[1], c[2], c[4], c[5], out=o,
                                                  workspace=ws, max_seq_len=ctx, window=window,
                                                  sinks=sinks)

                slide(copies[0], outs[0])()
                check_window(copies[0][0], copies[0][1], copies[0][2], copies[0][4],
                             copies[0][5], window, sinks, outs[0])
                t_full = graph_us([full(c, o) for c, o in zip(copies, outs)])
                t_slide = graph_us([slide(c, o) for c, o in zip(copies, outs)])
                row = dict(shape=label, batch=batch, context=ctx, window=window,
                           sinks=use_sinks, full_us=round(t_full, 2),
                           sliding_us=round(t_slide, 2), speedup=round(t_full / t_slide, 2))
                rows.append(row)
                print(f"{label:22s} {batch:5d} {ctx:8d} {window:6d} {t_full:10.1f} "
                      f"{t_slide:10.1f} {t_full / t_slide:8.1f}x", flush=True)
                del copies, outs, ws
                torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batch.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    print(f"device: {torch.cuda.get_device_name()}  dtype: {DT}  block_size: 16")
    print(f"{'shape':22s} {'batch':>5s} {'context':>8s} {'window':>6s} {'full us':>10s} "
          f"{'sliding us':>10s} {'speedup':>9s}")
    rows = bench(batches, contexts, SHAPES)
    res = dict(bench="kernels_local", device=torch.cuda.get_device_name(),
               when=datetime.datetime.now(datetime.timezone.utc).isoformat(), rows=rows)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
