"""pagedkv's kernels side by side with FlashInfer's, in one process, on the same tensors.

Every kernel is timed the same way: `triton.testing.do_bench` over a CUDA-graph replay of one
call (median, do_bench's L2 flush before every replay), and eagerly around the Python call.
FlashInfer is planned outside the graph (as a serving engine does), then captured.

Sections (`--only`, comma separated):
  decode  the anchor shapes (32 q / 8 kv / 128, bf16, block 16), other GQA ratios (MQA 16/1,
          32/4), head dims 64 and 256, block sizes 32 and 64, and a ragged batch of 128
          log-normal lengths; pagedkv with its heuristic split and with `DecodePlan`, against
          FlashInfer's tensor-core decode and its CUDA-core decode;
  fp8     e4m3 caches with a per-tensor scale, pagedkv against FlashInfer's tensor-core decode
          (both against their own bf16 figure);
  prefill 8 × 2048 new over 2048 cached and 1 × 8192 over 8192 (causal, bottom-right aligned),
          pagedkv against FlashInfer's FA3 (sm90) and FA2 backends; bf16 and fp8 caches;
  host    CPU time per eager call (the GPU drained, no sync inside): pagedkv's decode (split
          heuristic, plan) and prefill against FlashInfer's planned `run`.

FlashInfer compiles its kernels on first use. `--build` compiles the modules a section needs in
background processes (one per module) while pagedkv's kernels are timed, and the FlashInfer
timings wait for them. Without FlashInfer installed, its rows are skipped.

Usage (CUDA machine, repository root; benches/gpu_peers.sh installs FlashInfer first):
    PYTHONPATH=python python3 benches/bench_peers.py --build --json out/peers.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import (  # noqa: E402
    decode_batch,
    dobench_graph_us,
    eager_time_us,
    host_us,
    make_decode,
    make_prefill,
)

from pagedkv import kernels as K  # noqa: E402
from pagedkv.decode_plan import DecodePlan  # noqa: E402

DT = torch.bfloat16
FP8 = torch.float8_e4m3fn
RESULTS: list = []
WS_BYTES = 256 * 1024 * 1024

# (name, q_heads, kv_heads, head_dim, block, batch, ctx): the anchors first.
DECODE_SHAPES = [
    ("anchor", 32, 8, 128, 16, 1, 32768),
    ("anchor", 32, 8, 128, 16, 8, 8192),
    ("anchor", 32, 8, 128, 16, 64, 4096),
    ("anchor", 32, 8, 128, 16, 128, 2048),
    ("anchor", 32, 8, 128, 16, 256, 1024),
    ("MQA 16/1", 16, 1, 128, 16, 64, 4096),
    ("MQA 16/1", 16, 1, 128, 16, 8, 8192),
    ("GQA 32/4", 32, 4, 128, 16, 64, 4096),
    ("GQA 32/4", 32, 4, 128, 16, 8, 8192),
    ("hd 64", 32, 8, 64, 16, 64, 4096),
    ("hd 64", 32, 8, 64, 16, 8, 8192),
    ("hd 256", 16, 4, 256, 16, 64, 4096),
    ("block 32", 32, 8, 128, 32, 64, 4096),
    ("block 64", 32, 8, 128, 64, 64, 4096),
]
FP8_SHAPES = [(64, 4096), (128, 2048), (256, 1024), (8, 8192), (1, 32768)]
PREFILL_SHAPES = [(8, 2048, 2048), (1, 8192, 8192)]  # (seqs, new tokens each, cached each)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record(**kw):
    RESULTS.append(kw)
    return kw


def times(fn):
    return {"graph_us": dobench_graph_us(fn), "eager_us": eager_time_us(fn)}


def fp8_per_tensor(x):
    """(e4m3 copy of `x`, its one scale amax / 448 as a float)."""
    scale = (x.float().abs().amax() / 448.0).item()
    return (x.float() / scale).clamp(-448, 448).to(FP8), scale


# ---------------------------------------------------------------------------------------------
# FlashInfer


def flashinfer():
    try:
        import flashinfer as fi
    except Exception as exc:  # noqa: BLE001 - any failure means "no peer here"
        print(f"flashinfer unavailable: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None
    return fi


def csr(bt, lens, bs):
    """FlashInfer's page table (indptr, indices, last_page_len) from a block table."""
    nb = [triton.cdiv(n, bs) for n in lens]
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(nb).cumsum(0)
    rows = [bt[i, :n] for i, n in enumerate(nb)]
    indices = torch.cat(rows).int()
    last = torch.tensor([(n - 1) % bs + 1 for n in lens], dtype=torch.int32)
    return indptr.cuda(), indices.cuda(), last.cuda()


class FIDecode:
    """One planned FlashInfer decode wrapper for a batch (tensor cores or CUDA cores)."""

    def __init__(self, fi, bt, lens, q_heads, kv_heads, hd, bs, tensor_cores, kv_dtype=DT):
        self.ws = torch.zeros(WS_BYTES, dtype=torch.uint8, device="cuda")
        indptr, indices, last = csr(bt, lens, bs)
        self.w = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last)
        self.w.plan(indptr, indices, last, q_heads, kv_heads, hd, bs, q_data_type=DT,
                    kv_data_type=kv_dtype, o_data_type=DT)

    def fn(self, q, kc, vc, out, k_scale=None, v_scale=None):
        kw = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        return lambda: self.w.run(q, (kc, vc), out=out, **kw)


class FIPrefill:
    def __init__(self, fi, backend, bt, lens, q_lens, q_heads, kv_heads, hd, bs, kv_dtype=DT):
        self.ws = torch.zeros(WS_BYTES, dtype=torch.uint8, device="cuda")
        indptr, indices, last = csr(bt, lens, bs)
        qo = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qo[1:] = torch.tensor(q_lens).cumsum(0)
        self.w = fi.BatchPrefillWithPagedKVCacheWrapper(self.ws, "NHD", backend=backend)
        self.w.plan(qo.cuda(), indptr, indices, last, q_heads, kv_heads, hd, bs, causal=True,
                    q_data_type=DT, kv_data_type=kv_dtype, o_data_type=DT)

    def fn(self, q, kc, vc, out, k_scale=None, v_scale=None):
        kw = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        return lambda: self.w.run(q, (kc, vc), out=out, **kw)


def build_jobs(only):
    """FlashInfer module families the sections need, most important first."""
    order = [("decode_tc_128", "decode"), ("prefill_fa3", "prefill"), ("decode_tc_fp8", "fp8"),
             ("decode_cc_128", "decode"), ("prefill_fa2", "prefill"), ("decode_tc_64", "decode"),
             ("decode_tc_256", "decode"), ("prefill_fa3_fp8", "prefill fp8"),
             ("prefill_fa2_fp8", "prefill fp8"), ("decode_cc_64", "decode"),
             ("decode_cc_256", "decode")]
    return [job for job, need in order
            if all(n in only for n in need.split()) or ("host" in only and job in HOST_JOBS)]


def warm(job):
    """Compiles one FlashInfer module family by running it once on a tiny problem."""
    fi = flashinfer()
    if fi is None:
        return 1
    kind, *rest = job.split("_")
    hd = 128
    kv = DT
    for r in rest:
        if r.isdigit():
            hd = int(r)
        if r == "fp8":
            kv = FP8
    qh, kh, bs, lens = 32, 8, 16, [40, 300]
    nb = [triton.cdiv(n, bs) for n in lens]
    kc = torch.randn(sum(nb), bs, kh, hd, device="cuda", dtype=DT).to(kv)
    vc = torch.randn(sum(nb), bs, kh, hd, device="cuda", dtype=DT).to(kv)
    bt = torch.zeros(len(lens), max(nb), dtype=torch.int32, device="cuda")
    bt[0, :nb[0]] = torch.arange(nb[0], dtype=torch.int32)
    bt[1, :nb[1]] = torch.arange(nb[0], nb[0] + nb[1], dtype=torch.int32)
    sc = {} if kv is DT else {"k_scale": 0.5, "v_scale": 0.5}
    if kind == "decode":
        q = torch.randn(len(lens), qh, hd, device="cuda", dtype=DT)
        out = torch.empty_like(q)
        w = FIDecode(fi, bt, lens, qh, kh, hd, bs, tensor_cores=rest[0] == "tc", kv_dtype=kv)
        w.fn(q, kc, vc, out, **sc)()
    else:
        qlens = [8, 16]
        q = torch.randn(sum(qlens), qh, hd, device="cuda", dtype=DT)
        out = torch.empty_like(q)
        w = FIPrefill(fi, rest[0], bt, lens, qlens, qh, kh, hd, bs, kv_dtype=kv)
        w.fn(q, kc, vc, out, **sc)()
    torch.cuda.synchronize()
    return 0


class Builder:
    """Background compile processes, a few at a time; `wait(job)` blocks until one is done."""

    def __init__(self, jobs, parallel, logdir):
        self.pending = list(jobs)
        self.running: dict = {}
        self.done: dict = {}
        self.parallel = parallel
        self.logdir = logdir
        self.t0 = time.time()
        self.poll()

    def poll(self):
        for job, (p, t) in list(self.running.items()):
            if p.poll() is not None:
                self.done[job] = (p.returncode, time.time() - t)
                print(f"[build] {job}: rc={p.returncode} in {time.time() - t:.0f} s", flush=True)
                del self.running[job]
        while self.pending and len(self.running) < self.parallel:
            job = self.pending.pop(0)
            log = open(os.path.join(self.logdir, f"build_{job}.log"), "w")
            p = subprocess.Popen([sys.executable, __file__, "--warm", job], stdout=log,
                                 stderr=subprocess.STDOUT)
            self.running[job] = (p, time.time())

    def wait(self, job, limit_s):
        while job not in self.done and (job in self.running or job in self.pending):
            if time.time() - self.t0 > limit_s:
                print(f"[build] {job}: not built within {limit_s:.0f} s, skipped", flush=True)
                return False
            time.sleep(1.0)
            self.poll()
        return self.done.get(job, (1, 0))[0] == 0


class NoBuilder:
    def wait(self, job, limit_s):
        return True

    def poll(self):
        pass


# ---------------------------------------------------------------------------------------------
# Sections


def row_print(name, ours, peers):
    best = min((t["graph_us"], n) for n, t in peers.items()) if peers else None
    s = f"{name:44s} pagedkv {ours['graph_us']:8.1f} us"
    for n, t in peers.items():
        s += f" | {n} {t['graph_us']:8.1f}"
    if best:
        s += f" | ratio to best ({best[1]}) {ours['graph_us'] / best[0]:5.3f}"
    print(s, flush=True)


def decode_section(fi, builder, limit_s, with_ragged=True):
    shapes = list(DECODE_SHAPES)
    if with_ragged:
        shapes.append(("ragged 128", 32, 8, 128, 16, 128, None))
    pending = []  # pagedkv timings first (while FlashInfer builds), peers afterwards
    for name, qh, kh, hd, bs, batch, ctx in shapes:
        try:
            lens, sets, sl = decode_batch(batch, ctx, q_heads=qh, kv_heads=kh, hd=hd, bs=bs)
            q, kc, vc, bt = sets[0]
            nbytes = 2 * sum(lens) * kh * hd * kc.element_size()
            out = torch.empty_like(q)
            ws = K.DecodeWorkspace(batch, qh, kh, hd, device="cuda")
            plan = DecodePlan(batch, qh, kh, hd, device="cuda")
            plan.update(lens)
            heur = times(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws))
            ref = out.clone()
            planned = times(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan))
            perr = rel_err(out, ref)
            label = f"{name} b={batch} " + (f"ctx={ctx}" if ctx else f"sum={sum(lens)}")
            pending.append((label, name, qh, kh, hd, bs, batch, ctx, lens, sets, sl, out, ref,
                            nbytes, heur, planned, perr))
            print(f"decode {label:36s} pagedkv heuristic {heur['graph_us']:8.1f} us, plan "
                  f"{planned['graph_us']:8.1f} us ({nbytes / planned['graph_us'] / 1e6:4.2f} TB/s)",
                  flush=True)
        except Exception:  # noqa: BLE001 - one failing shape must not end the run
            traceback.print_exc()
        builder.poll()
    for (label, name, qh, kh, hd, bs, batch, ctx, lens, sets, sl, out, ref, nbytes, heur, planned,
         perr) in pending:
        q, kc, vc, bt = sets[0]
        peers = {}
        errs = {}
        for tc in (True, False):
            job = f"decode_{'tc' if tc else 'cc'}_{hd}"
            pname = "fi_tc" if tc else "fi_cc"
            if fi is None or not builder.wait(job, limit_s):
                continue
            try:
                o2 = torch.empty_like(q)
                w = FIDecode(fi, bt, lens, qh, kh, hd, bs, tensor_cores=tc)
                f = w.fn(q, kc, vc, o2)
                f()
                errs[pname] = rel_err(o2, ref)
                peers[pname] = times(f)
                del w
            except Exception as exc:  # noqa: BLE001
                print(f"  {pname} {label}: failed {type(exc).__name__}: {str(exc)[:160]}",
                      flush=True)
        ours = min((heur, planned), key=lambda t: t["graph_us"])
        best = min((t["graph_us"] for t in peers.values()), default=None)
        record(section="decode", shape=name, label=label, q_heads=qh, kv_heads=kh, head_dim=hd,
               block=bs, batch=batch, ctx=ctx, total_tokens=sum(lens), bytes=nbytes,
               pagedkv_heuristic=heur, pagedkv_plan=planned, plan_vs_heuristic_err=perr,
               peers=peers, peer_err_vs_pagedkv=errs,
               ratio_plan_to_best_peer=None if best is None else planned["graph_us"] / best,
               ratio_heuristic_to_best_peer=None if best is None else heur["graph_us"] / best)
        row_print(label + " (plan)", planned, peers)
        if peers:
            print(f"  heuristic {heur['graph_us']:.1f} us ratio {heur['graph_us'] / best:5.3f};"
                  f" best pagedkv {ours['graph_us']:.1f}; peer vs pagedkv err "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
        del sets
        torch.cuda.empty_cache()


def fp8_section(fi, builder, limit_s):
    for batch, ctx in FP8_SHAPES:
        try:
            sets, sl = make_decode(batch, ctx, copies=1)
            q, kc, vc, bt = sets[0]
            lens = [ctx] * batch
            k8, ks = fp8_per_tensor(kc)
            v8, vs = fp8_per_tensor(vc)
            kst = torch.tensor([ks], device="cuda")
            vst = torch.tensor([vs], device="cuda")
            out = torch.empty_like(q)
            out8 = torch.empty_like(q)
            plan = DecodePlan(batch, 32, 8, 128, device="cuda")
            plan.update(lens)
            t16 = times(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan))
            t8 = times(lambda: K.paged_decode(q, k8, v8, bt, sl, out=out8, plan=plan,
                                              k_scale=kst, v_scale=vst))
            err = rel_err(out8, out)
            peers = {}
            if fi is not None and builder.wait("decode_tc_fp8", limit_s) and \
                    builder.wait("decode_tc_128", limit_s):
                try:
                    o2 = torch.empty_like(q)
                    w16 = FIDecode(fi, bt, lens, 32, 8, 128, 16, tensor_cores=True)
                    f16 = w16.fn(q, kc, vc, o2)
                    peers["fi_tc bf16"] = times(f16)
                    w8 = FIDecode(fi, bt, lens, 32, 8, 128, 16, tensor_cores=True, kv_dtype=FP8)
                    f8 = w8.fn(q, k8, v8, o2, k_scale=ks, v_scale=vs)
                    f8()
                    peers["fi_tc fp8 err vs pagedkv fp8"] = rel_err(o2, out8)
                    peers["fi_tc fp8"] = times(f8)
                except Exception as exc:  # noqa: BLE001
                    print(f"  fi fp8 b={batch} ctx={ctx}: failed {type(exc).__name__}: "
                          f"{str(exc)[:160]}", flush=True)
            record(section="fp8", batch=batch, ctx=ctx, pagedkv_bf16=t16, pagedkv_fp8=t8,
                   fp8_vs_bf16_err=err, peers=peers,
                   pagedkv_speedup=t16["graph_us"] / t8["graph_us"])
            s = (f"fp8 b={batch:4d} ctx={ctx:6d}: pagedkv bf16 {t16['graph_us']:7.1f} fp8 "
                 f"{t8['graph_us']:7.1f} us ({t16['graph_us'] / t8['graph_us']:4.2f}x, err {err:.1e})")
            if "fi_tc fp8" in peers:
                a, b = peers["fi_tc bf16"]["graph_us"], peers["fi_tc fp8"]["graph_us"]
                s += (f" | fi_tc bf16 {a:7.1f} fp8 {b:7.1f} us ({a / b:4.2f}x) | pagedkv fp8 / "
                      f"fi fp8 {t8['graph_us'] / b:5.3f}")
            print(s, flush=True)
            del sets, k8, v8
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def prefill_section(fi, builder, limit_s, with_fp8, configs=()):
    qh, kh, hd, bs = 32, 8, 128, 16
    for nseq, q_len, prefix in PREFILL_SHAPES:
        try:
            q, kc, vc, bt, sl, qsl = make_prefill(nseq, q_len, prefix, qh, kh, hd, bs)
            ctx = prefix + q_len
            out = torch.empty_like(q)
            pairs = nseq * (q_len * prefix + q_len * (q_len + 1) // 2)
            flops = 4 * hd * qh * pairs
            kinds = [("bf16", kc, vc, None, None)]
            if with_fp8:
                k8, ks = fp8_per_tensor(kc)
                v8, vs = fp8_per_tensor(vc)
                kinds.append(("fp8", k8, v8, ks, vs))
            for kname, k_, v_, ks, vs in kinds:
                sc = {} if ks is None else {"k_scale": torch.tensor([ks], device="cuda"),
                                            "v_scale": torch.tensor([vs], device="cuda")}
                ours = times(lambda: K.paged_prefill(q, k_, v_, bt, sl, qsl, q_len, out=out, **sc))
                ref = out.clone()
                variants = {}
                for cfg in (configs if ks is not None else []):
                    try:
                        variants[json.dumps(cfg, sort_keys=True)] = times(
                            lambda cfg=cfg: K.paged_prefill(q, k_, v_, bt, sl, qsl, q_len,
                                                            out=out, config=cfg, **sc))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  config {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
                peers, errs = {}, {}
                for backend in ("fa3", "fa2"):
                    job = f"prefill_{backend}" + ("" if ks is None else "_fp8")
                    if fi is None or not builder.wait(job, limit_s):
                        continue
                    try:
                        o2 = torch.empty_like(q)
                        w = FIPrefill(fi, backend, bt, [ctx] * nseq, [q_len] * nseq, qh, kh, hd,
                                      bs, kv_dtype=k_.dtype)
                        f = w.fn(q, k_, v_, o2, **({} if ks is None else
                                                   {"k_scale": ks, "v_scale": vs}))
                        f()
                        errs[backend] = rel_err(o2, ref)
                        peers[backend] = times(f)
                        del w
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {backend} {kname} prefill: failed {type(exc).__name__}: "
                              f"{str(exc)[:160]}", flush=True)
                label = f"prefill {kname} {nseq}x{q_len} over {prefix}"
                record(section="prefill", kv=kname, seqs=nseq, q_len=q_len, prefix=prefix,
                       flops=flops, pagedkv=ours, pagedkv_configs=variants, peers=peers,
                       peer_err_vs_pagedkv=errs,
                       pagedkv_tflops=flops / ours["graph_us"] / 1e6,
                       peer_tflops={k: flops / t["graph_us"] / 1e6 for k, t in peers.items()})
                s = f"{label:36s} pagedkv {ours['graph_us']:8.1f} us {flops / ours['graph_us'] / 1e6:5.0f} TFLOP/s"
                for k, t in peers.items():
                    s += (f" | {k} {t['graph_us']:8.1f} us {flops / t['graph_us'] / 1e6:5.0f} "
                          f"(ours/{k} {ours['graph_us'] / t['graph_us']:5.3f}, err {errs[k]:.1e})")
                print(s, flush=True)
                for c, t in variants.items():
                    print(f"  pagedkv config {c}: {t['graph_us']:8.1f} us "
                          f"{flops / t['graph_us'] / 1e6:5.0f} TFLOP/s", flush=True)
            del kc, vc, kinds
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            traceback.print_exc()


HOST_JOBS = ("decode_tc_128", "prefill_fa2")


def host_section(fi, builder, limit_s):
    """Host µs per eager call, pagedkv against FlashInfer's planned `run`, same tensors. Timed
    after FlashInfer's compiles are done, so the CPU is idle."""
    built = {job: fi is not None and builder.wait(job, limit_s) for job in HOST_JOBS}
    rows = []
    small = torch.zeros(1, device="cuda")
    floor = host_us(lambda: small.add_(1.0))
    rows.append(("torch small.add_ (launch floor)", floor, None))
    for name, batch, ctx in (("64 x 4096", 64, 4096), ("ragged 128", 128, None)):
        lens, sets, sl = decode_batch(batch, ctx)
        q, kc, vc, bt = sets[0]
        out = torch.empty_like(q)
        ws = K.DecodeWorkspace(batch, 32, 8, 128, device="cuda")
        plan = DecodePlan(batch, 32, 8, 128, device="cuda").update(lens)
        ours = host_us(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, workspace=ws))
        ours_plan = host_us(lambda: K.paged_decode(q, kc, vc, bt, sl, out=out, plan=plan))
        peer = None
        if built["decode_tc_128"]:
            w = FIDecode(fi, bt, lens, 32, 8, 128, 16, tensor_cores=True)
            peer = host_us(w.fn(q, kc, vc, torch.empty_like(q)))
        rows.append((f"decode {name}, split heuristic", ours, peer))
        rows.append((f"decode {name}, plan", ours_plan, peer))
        del sets
    nseq, ql, pre = 4, 512, 1024
    pq, pkc, pvc, pbt, psl, pqsl = make_prefill(nseq, ql, pre)
    pout = torch.empty_like(pq)
    ours = host_us(lambda: K.paged_prefill(pq, pkc, pvc, pbt, psl, pqsl, ql, out=pout))
    peer = None
    if built["prefill_fa2"]:
        w = FIPrefill(fi, "fa2", pbt, [pre + ql] * nseq, [ql] * nseq, 32, 8, 128, 16)
        peer = host_us(w.fn(pq, pkc, pvc, torch.empty_like(pq)))
    rows.append(("prefill 4 x 512 over 1024", ours, peer))
    for name, ours, peer in rows:
        record(section="host", case=name, pagedkv_host_us=ours, flashinfer_host_us=peer)
        print(f"host {name:36s} pagedkv {ours:6.1f} us" +
              ("" if peer is None else f" | flashinfer run() {peer:6.1f} us"), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="decode,fp8,prefill")
    ap.add_argument("--json", default=None)
    ap.add_argument("--build", action="store_true",
                    help="compile FlashInfer's modules in background processes first")
    ap.add_argument("--build-parallel", type=int, default=4)
    ap.add_argument("--build-limit-s", type=float, default=420.0,
                    help="give up on a module not built this long after the start")
    ap.add_argument("--no-ragged", action="store_true")
    ap.add_argument("--build-logs", default="/tmp/pagedkv_fi_build",
                    help="folder for the background compiles' logs")
    ap.add_argument("--prefill-fp8-configs", default="[]",
                    help="JSON list of paged_prefill config overrides also timed on fp8 caches")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warm:
        return warm(args.warm)
    only = set(args.only.split(","))
    os.makedirs(args.build_logs, exist_ok=True)
    fi = flashinfer()
    builder = (Builder(build_jobs(only), args.build_parallel, args.build_logs) if (args.build and fi)
               else NoBuilder())
    dev = torch.cuda.get_device_name()
    print(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}, flashinfer "
          f"{getattr(fi, '__version__', None)}", flush=True)
    if "decode" in only:
        decode_section(fi, builder, args.build_limit_s, with_ragged=not args.no_ragged)
    if "fp8" in only:
        fp8_section(fi, builder, args.build_limit_s)
    if "prefill" in only:
        prefill_section(fi, builder, args.build_limit_s, with_fp8="fp8" in only,
                        configs=json.loads(args.prefill_fp8_configs))
    if "host" in only:
        host_section(fi, builder, args.build_limit_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "triton": triton.__version__,
                       "flashinfer": getattr(fi, "__version__", None),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "results": RESULTS}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
