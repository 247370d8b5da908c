"""Prefix hit ratio against pool occupancy on a multi-session chat trace, with KV cache groups.

Run:  PYTHONPATH=python .venv/bin/python benches/bench_groups_chat.py [--json out.json]
          [--plot out.png] [--quick]
      (with vLLM importable, e.g. PYTHONPATH=.vllm-test/site:python, vLLM's own KVCacheManager
      runs the same trace beside; scripts/test_vllm.sh installs it into .vllm-test/site)

CPU only: the managers' bookkeeping, no model. The model is Gemma-3-27B-shaped: 62 layers, 10
full and 52 sliding (window 1024), 16 KV heads × 128 × bf16 (8 KiB a layer per token); block
size 16. The same KV memory (``--kv-gib``) is run three ways:

- ``groups``: pagedkv's manager with the grouping :func:`pagedkv.config.size_groups` picks
  (31 groups of 2 layers; pages of 256 KiB);
- ``full``: pagedkv's manager with the same model counted as full attention (one group, blocks of
  all 62 layers, 7.75 MiB);
- ``vllm``: vLLM's ``KVCacheManager`` with the groups vLLM's own planner
  (``_get_kv_cache_groups_uniform_page_size``) makes of the model: pages of 10 layers, one full
  group and six sliding groups (8 padded slots) — when vLLM is importable.

The trace: chat sessions, each a shared 512-token system prompt, a document of 2000–6000 tokens
and then 6 turns of a user message (50–300 tokens) and an answer (100–600 tokens); each turn's
prompt is the session's whole history plus the new message, so it can hit the history in the
prefix cache. A prompt is prefilled in chunks of 2048 tokens (``--prefill-chunk``), a step each,
as an engine's chunked prefill does. ``N`` turns run at once (a lockstep decode batch: one token a step each); there are
``3 N`` sessions, and when a turn ends a session chosen at random among the idle ones takes the
next turn (sessions interleave; a finished session is replaced by a new one). For each target
occupancy (25%–95%), ``N`` is the target times the pool over the mean pages a running turn holds
(exact per-group live blocks along the trace's lengths), so the live sequences fill about that
share of the pool and the rest keeps cached histories. Measured after a warm-up (the first
``2 × sessions`` turns): the mean occupancy (pages held by running sequences over the pool, per
step), the mean concurrency, and the prefix hit ratio (cached prompt tokens over prompt tokens of
the turns admitted, retries after a preemption not counted). A decode step that runs out of pages
preempts the newest turn (freed, retried later). The ceiling is the hit ratio of an unbounded
cache (the history's full blocks). Of the turns after a session's first: ``whole``, the share
whose hit covered the whole history; ``partial``, the share that hit part of it (more than the
system prompt, less than the whole).

``--concurrency-ratio R`` also runs the groups configuration at exactly ``R`` times full
accounting's ``N`` at each target (config ``groups_Rx``), in the same memory, and compares its hit
ratio with full accounting's at the same target: the question "with ``R``× the concurrency, what
share of full accounting's hit ratio is kept" (its occupancy is then below full's, the rest of
the pool keeping histories).

Prints a table, writes JSON (``--json``) and plots hit ratio and concurrency against occupancy
(``--plot``, matplotlib; skipped with a message when it is not installed).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pagedkv import BlockManager, StepBuffers
from pagedkv.config import CacheSpec, size_groups
from pagedkv.errors import OutOfBlocksError
from pagedkv.groups import KVCacheGroup, live_blocks

B = 16
LAYERS = 62
WINDOW = 1024
KINDS = [("full", 0) if (i + 1) % 6 == 0 else ("sliding", WINDOW) for i in range(LAYERS)]
SPEC = CacheSpec(num_layers=LAYERS, num_kv_heads=16, head_dim=128, dtype="bfloat16", block_size=B)
LAYER_BYTES = SPEC.bytes_per_token // LAYERS  # per token
SYSTEM = 512
TURNS = 6
#: Prompt tokens a prefill step computes (chunked prefill): the windowed groups hold a chunk
#: plus a window while prefilling, not the whole prompt.
CHUNK = 2048


# ------------------------------------------------------------------------------------ the trace

class Session:
    """One chat: its token history and the turns still to come."""

    __slots__ = ("sid", "history", "computed", "turns", "rng")

    def __init__(self, sid: int, system: List[int], seed: int) -> None:
        self.sid = sid
        self.rng = random.Random(seed * 1_000_003 + sid)
        doc = self.rng.randint(2000, 6000)
        self.history = system + [self.rng.randrange(1, 250_000) for _ in range(doc)]
        #: Leading tokens of the history some earlier turn computed (the shared system prompt).
        self.computed = len(system)
        self.turns = TURNS

    def next_turn(self) -> Tuple[List[int], List[int]]:
        """(prompt, answer) of the next turn; the caller appends both to the history when the
        turn completes."""
        user = [self.rng.randrange(1, 250_000) for _ in range(self.rng.randint(50, 300))]
        answer = [self.rng.randrange(1, 250_000) for _ in range(self.rng.randint(100, 600))]
        return self.history + user, answer


def mean_live_tokens_profile(seed: int, n: int = 400) -> List[Tuple[int, int]]:
    """(prompt length, answer length) of ``n`` turns drawn as the trace draws them."""
    out = []
    system = [0] * SYSTEM
    for sid in range(n // TURNS + 1):
        s = Session(sid, system, seed + 7)
        for _ in range(TURNS):
            p, a = s.next_turn()
            out.append((len(p), len(a)))
            s.history = p + a
    return out[:n]


def mean_live_pages(groups: Sequence[Tuple[str, int]], profile: List[Tuple[int, int]]) -> float:
    """Pages a running turn holds on average over its decode steps (every group's live blocks)."""
    total = 0
    steps = 0
    for p, a in profile:
        for length in range(p + 1, p + a + 1, 8):  # every 8th step: close enough for a mean
            total += sum(live_blocks(g, length, 1, B) for g in groups)
            steps += 1
    return total / steps


# ------------------------------------------------------------------------------------- backends

class PagedBackend:
    """pagedkv's BlockManager, with or without groups."""

    def __init__(self, num_blocks: int, groups: Optional[Sequence[KVCacheGroup]], max_seqs: int,
                 max_tokens: int) -> None:
        self.num_blocks = num_blocks
        self.mgr = BlockManager(num_blocks, B, groups=groups, watermark_blocks=0,
                                max_blocks_per_seq=max_tokens // B + 2)
        ng = 1 if groups is None else len(groups)
        self.buf = StepBuffers(max_seqs, max_tokens + max_seqs, max_tokens // B + 2,
                               device="cpu", backend="numpy", num_groups=ng)
        self.mgr.attach_buffers(self.buf)

    def admit(self, rid: int, prompt: List[int]) -> Optional[int]:
        """Admit and prefill ``prompt`` in chunks of :data:`CHUNK` tokens (a step each, as an
        engine's chunked prefill does); the cached tokens, or None when the pool is full."""
        try:
            res = self.mgr.admit(rid, prompt, max_new_tokens=CHUNK)
            self.mgr.step([rid], [res.num_tokens - res.cached_tokens])
            held = res.num_tokens
            while held < len(prompt):
                chunk = prompt[held:held + CHUNK]
                self.mgr.append(rid, chunk)
                self.mgr.step([rid], [len(chunk)])
                held += len(chunk)
        except OutOfBlocksError:
            if rid in self.mgr:
                self.mgr.free(rid)
            return None
        return int(res.cached_tokens)

    def decode(self, rids: List[int], toks: List[int]) -> bool:
        try:
            self.mgr.append_batch(rids, toks)
        except OutOfBlocksError:
            return False
        self.mgr.step(rids, 1)
        return True

    def free(self, rid: int) -> None:
        self.mgr.free(rid)

    def live(self) -> int:
        return int(self.mgr.stats().used_blocks)


class VllmBackend:
    """vLLM's KVCacheManager on vLLM's grouping of the same model."""

    def __init__(self, kv_bytes: int, max_tokens: int) -> None:
        import torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

        init_none_hash(sha256)
        full = FullAttentionSpec(block_size=B, num_kv_heads=16, head_size=128,
                                 dtype=torch.bfloat16)
        sliding = SlidingWindowSpec(block_size=B, num_kv_heads=16, head_size=128,
                                    dtype=torch.bfloat16, sliding_window=WINDOW)
        specs = {f"layers.{i}": (full if k == "full" else sliding) for i, (k, _) in enumerate(KINDS)}
        groups = _get_kv_cache_groups_uniform_page_size(specs)
        self.group_layers = [len(g.layer_names) for g in groups]
        self.slots = max(self.group_layers)
        self.groups = [("full", 0) if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"
                       else ("sliding", WINDOW) for g in groups]
        page = full.page_size_bytes * self.slots
        assert full.page_size_bytes == LAYER_BYTES * B
        self.num_blocks = kv_bytes // page
        cfg = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.m = KVCacheManager(cfg, max_model_len=max_tokens, scheduler_block_size=B,
                                hash_block_size=B, enable_caching=True)
        self.hasher = get_request_block_hasher(B, sha256)
        self.reqs: Dict[int, Any] = {}
        self._done: set[int] = set()  # allocated in the decode step being tried
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._sp, self._req = SamplingParams, Request

    def admit(self, rid: int, prompt: List[int]) -> Optional[int]:
        sp = self._sp(max_tokens=1 << 20)
        sp.update_from_generation_config({}, eos_token_id=None)
        req = self._req(request_id=str(rid), prompt_token_ids=prompt, sampling_params=sp,
                        pooling_params=None, block_hasher=self.hasher)
        blocks, hit = self.m.get_computed_blocks(req)[:2]
        first = min(CHUNK, len(prompt) - hit)
        if self.m.allocate_slots(req, first, hit, blocks) is None:
            return None
        req.num_computed_tokens = hit + first
        while req.num_computed_tokens < len(prompt):
            n = min(CHUNK, len(prompt) - req.num_computed_tokens)
            if self.m.allocate_slots(req, n) is None:
                self.m.free(req)
                return None
            req.num_computed_tokens += n
        self.reqs[rid] = req
        return int(hit)

    def decode(self, rids: List[int], toks: List[int]) -> bool:
        for rid, tok in zip(rids, toks):
            if rid in self._done:
                continue  # allocated on an earlier try of this step
            req = self.reqs[rid]
            if req.num_tokens == req.num_computed_tokens:
                req.append_output_token_ids(tok)
            if self.m.allocate_slots(req, 1) is None:
                return False
            self._done.add(rid)
        for rid in rids:
            self.reqs[rid].num_computed_tokens += 1
        self._done.clear()
        return True

    def free(self, rid: int) -> None:
        self._done.discard(rid)
        self.m.free(self.reqs.pop(rid))

    def live(self) -> int:
        return self.num_blocks - 1 - self.m.block_pool.get_num_free_blocks()


# ------------------------------------------------------------------------------------ the driver

def run(backend: Any, n_running: int, seed: int, turns_total: int) -> Dict[str, Any]:
    """Run the chat trace with ``n_running`` turns at once until ``turns_total`` turns finished."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250_000) for _ in range(SYSTEM)]
    n_sessions = 3 * n_running
    next_sid = 0
    idle: List[Session] = []
    for _ in range(n_sessions):
        idle.append(Session(next_sid, system, seed))
        next_sid += 1
    warmup = 2 * n_sessions
    running: List[Tuple[int, Session, List[int], List[int], int]] = []  # rid, s, prompt, answer, done
    retry: List[Tuple[Session, List[int], List[int]]] = []
    rid = 0
    finished = 0
    started = 0
    hit = prompt_tokens = ceiling = 0
    later = [0, 0, 0]  # later turns measured; of them, whole-history hits; partial hits
    occ_sum = conc_sum = 0.0
    steps = measured_steps = preemptions = stalls = 0

    def admit_one() -> bool:
        nonlocal rid, started, hit, prompt_tokens, ceiling
        if retry:
            s, prompt, answer = retry[-1]
            first = False
        else:
            s = idle.pop(rng.randrange(len(idle)))
            prompt, answer = s.next_turn()
            first = True
        got = backend.admit(rid, prompt)
        if got is None:
            if first:
                retry.append((s, prompt, answer))
            return False
        if not first:
            retry.pop()
        elif started >= warmup:
            hit += got
            prompt_tokens += len(prompt)
            best = min(s.computed, len(prompt) - 1) // B * B
            ceiling += best
            if best > SYSTEM:  # a later turn: its history was computed
                later[0] += 1
                later[1] += got >= best
                later[2] += SYSTEM < got < best
        if first:
            started += 1
        running.append((rid, s, prompt, answer, 0))
        rid += 1
        return True

    while finished < turns_total:
        while len(running) < n_running:
            if not admit_one():
                stalls += 1
                break
        if not running:
            raise RuntimeError("the pool cannot hold one turn: enlarge --kv-gib")
        rids = [r[0] for r in running]
        toks = [r[3][r[4]] for r in running]
        while not backend.decode(rids, toks):
            # Out of pages mid-decode: preempt the newest turn, retried later from the start.
            r = running.pop()
            backend.free(r[0])
            retry.append((r[1], r[2], r[3]))
            preemptions += 1
            rids.pop()
            toks.pop()
            if not running:
                raise RuntimeError("the pool cannot hold one turn: enlarge --kv-gib")
        steps += 1
        if started >= warmup:
            occ_sum += backend.live() / backend.num_blocks
            conc_sum += len(running)
            measured_steps += 1
        still = []
        for r in running:
            r = (r[0], r[1], r[2], r[3], r[4] + 1)
            if r[4] == len(r[3]):
                backend.free(r[0])
                s = r[1]
                s.history = r[2] + r[3]
                s.computed = len(s.history)
                s.turns -= 1
                if s.turns == 0:
                    s = Session(next_sid, system, seed)
                    next_sid += 1
                idle.append(s)
                finished += 1
            else:
                still.append(r)
        running[:] = still
    return {
        "n_running": n_running,
        "sessions": n_sessions,
        "turns": finished,
        "measured_turns": max(0, started - warmup),
        "steps": steps,
        "occupancy": occ_sum / measured_steps if measured_steps else 0.0,
        "concurrency": conc_sum / measured_steps if measured_steps else 0.0,
        "hit_ratio": hit / prompt_tokens if prompt_tokens else 0.0,
        "ceiling": ceiling / prompt_tokens if prompt_tokens else 0.0,
        "whole_history_hits": later[1] / later[0] if later[0] else 0.0,
        "partial_history_hits": later[2] / later[0] if later[0] else 0.0,
        "preemptions": preemptions,
        "admission_stalls": stalls,
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-gib", type=float, default=64.0, help="KV memory, GiB (default 64)")
    ap.add_argument("--targets", default="25,40,55,70,80,90,95",
                    help="target occupancies, percent (default 25,40,55,70,80,90,95)")
    ap.add_argument("--turns-per-slot", type=int, default=24,
                    help="turns run per concurrent turn after the warm-up (default 24)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=CHUNK,
                    help=f"prompt tokens per prefill step (default {CHUNK})")
    ap.add_argument("--quick", action="store_true", help="16 GiB, three targets, fewer turns")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's manager")
    ap.add_argument("--concurrency-ratio", type=float, default=None, metavar="R",
                    help="also run groups at R times full accounting's concurrency at each target "
                         "(config 'groups_Rx'), compared with full at the same target")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PNG")
    args = ap.parse_args(argv)
    if args.quick:
        args.kv_gib, args.targets, args.turns_per_slot = 16.0, "25,70,90", 8
    targets = [int(t) / 100 for t in args.targets.split(",")]
    globals()["CHUNK"] = args.prefill_chunk
    kv = int(args.kv_gib * 2**30)
    sizing = size_groups(SPEC, KINDS, kv, 16384)
    vllm_error = None
    vllm_probe = None
    if not args.no_vllm:
        try:
            vllm_probe = VllmBackend(kv, 16384)
        except ImportError as exc:
            vllm_error = f"vLLM not importable ({exc}); its column did not run"
    configs: Dict[str, Dict[str, Any]] = {
        "groups": {"groups": [g.as_tuple() for g in sizing.groups], "pages": sizing.num_blocks,
                   "page_bytes": sizing.page_bytes},
        "full": {"groups": [("full", 0)], "pages": sizing.full_num_blocks,
                 "page_bytes": SPEC.bytes_per_block},
    }
    if vllm_probe is not None:
        configs["vllm"] = {"groups": vllm_probe.groups, "pages": vllm_probe.num_blocks,
                           "page_bytes": vllm_probe.slots * LAYER_BYTES * B}
    profile = mean_live_tokens_profile(args.seed)
    for c in configs.values():
        c["mean_live_pages"] = mean_live_pages(c["groups"], profile)
    max_tokens = 16384
    rows: List[Dict[str, Any]] = []
    print(f"Gemma-3-27B-shaped chat trace, {args.kv_gib:g} GiB of KV, block size {B}; "
          f"pagedkv groups: {sizing.num_groups} of {sizing.grouping.slots} layers"
          + (f"; vLLM groups: {len(vllm_probe.groups)} of {vllm_probe.slots} layers"
             if vllm_probe is not None else ""))
    if vllm_error:
        print(vllm_error)
    header = (f"{'config':<7} {'target':>6} {'N':>5} {'occupancy':>9} {'concurrency':>11} "
              f"{'hit ratio':>9} {'ceiling':>7} {'whole':>6} {'partial':>7} {'preempt':>7} "
              f"{'seconds':>7}")
    print(header)
    # Full accounting runs fewer, longer-lived sequences: its measured occupancy falls short of
    # the target, so one more point past the last target lets every other run be compared at
    # its own occupancy.
    plan = [(t, name) for t in targets for name in configs]
    fixed = None
    if args.concurrency_ratio:
        fixed = f"groups_{args.concurrency_ratio:g}x"
    plan.append((targets[-1] + 0.1, "full"))
    if fixed is not None:
        plan += [(t, fixed) for t in targets + [targets[-1] + 0.1]]

    def running(name: str, target: float) -> int:
        """Turns run at once for ``target`` occupancy: the pool over a turn's mean live pages."""
        c = configs[name]
        return max(1, round(target * c["pages"] / c["mean_live_pages"]))

    for target, name in plan:
        if name == fixed:
            c = configs["groups"]
            n = round(args.concurrency_ratio * running("full", target))
        else:
            c = configs[name]
            n = running(name, target)
        if name == "vllm":
            backend: Any = VllmBackend(kv, max_tokens)
        else:
            groups = None if name == "full" else sizing.groups
            backend = PagedBackend(c["pages"], groups, n, max_tokens)
        t0 = time.perf_counter()
        res = run(backend, n, args.seed, (2 * 3 + args.turns_per_slot) * n)
        res.update(config=name, target=target, seconds=time.perf_counter() - t0)
        rows.append(res)
        print(f"{name:<7} {target:>6.0%} {n:>5} {res['occupancy']:>9.1%} "
              f"{res['concurrency']:>11.1f} {res['hit_ratio']:>9.1%} {res['ceiling']:>7.1%} "
              f"{res['whole_history_hits']:>6.1%} {res['partial_history_hits']:>7.1%} "
              f"{res['preemptions']:>7} {res['seconds']:>7.1f}")
    summary = compare(rows, list(configs) + ([fixed] if fixed else []))
    print()
    print("against full-attention accounting at the same measured occupancy (full's figures "
          "interpolated linearly between its points):")
    print(f"{'config':<7} {'occupancy':>9} {'hit / full':>10} {'concurrency / full':>18}")
    for c in summary:
        hit = "—" if c["hit_vs_full"] is None else f"{c['hit_vs_full']:.3f}"
        conc = "—" if c["concurrency_vs_full"] is None else f"{c['concurrency_vs_full']:.2f}"
        print(f"{c['config']:<7} {c['occupancy']:>9.1%} {hit:>10} {conc:>18}")
    same_target = []
    if fixed is not None:
        full_rows = {r["target"]: r for r in rows if r["config"] == "full"}
        print()
        print(f"groups at {args.concurrency_ratio:g}x full accounting's concurrency, against full "
              f"at the same target (same memory):")
        print(f"{'target':>6} {'full occ':>8} {'full hit':>8} {'groups occ':>10} "
              f"{'groups hit':>10} {'hit / full':>10} {'conc / full':>11}")
        for r in sorted((r for r in rows if r["config"] == fixed), key=lambda r: r["target"]):
            f = full_rows[r["target"]]
            ratio = r["hit_ratio"] / f["hit_ratio"] if f["hit_ratio"] else None
            same_target.append({"target": r["target"], "hit_vs_full": ratio,
                                "concurrency_vs_full": r["concurrency"] / f["concurrency"]})
            print(f"{r['target']:>6.0%} {f['occupancy']:>8.1%} {f['hit_ratio']:>8.1%} "
                  f"{r['occupancy']:>10.1%} {r['hit_ratio']:>10.1%} "
                  f"{'—' if ratio is None else format(ratio, '.3f'):>10} "
                  f"{r['concurrency'] / f['concurrency']:>11.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bench": "groups_chat", "python": sys.version.split()[0],
                       "machine": platform.machine(), "kv_gib": args.kv_gib, "seed": args.seed,
                       "turns_per_slot": args.turns_per_slot, "vllm": vllm_error or "ran",
                       "configs": {k: {kk: vv for kk, vv in v.items()} for k, v in configs.items()},
                       "rows": rows, "vs_full": summary,
                       "vs_full_same_target": same_target}, fh, indent=2)
    if args.plot:
        plot(rows, list(configs) + ([fixed] if fixed else []), args.plot, args.kv_gib)
    return 0


def _interp(x: float, xs: List[float], ys: List[float]) -> Optional[float]:
    """``ys`` at ``x`` by linear interpolation over ascending ``xs``; None outside their range."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def compare(rows: List[Dict[str, Any]], names: List[str]) -> List[Dict[str, Any]]:
    """Each non-full row's hit ratio and concurrency over full accounting's at its occupancy."""
    full = sorted((r for r in rows if r["config"] == "full"), key=lambda r: r["occupancy"])
    xs = [r["occupancy"] for r in full]
    out = []
    for name in names:
        if name == "full":
            continue
        for r in sorted((r for r in rows if r["config"] == name), key=lambda r: r["occupancy"]):
            h = _interp(r["occupancy"], xs, [f["hit_ratio"] for f in full])
            c = _interp(r["occupancy"], xs, [f["concurrency"] for f in full])
            out.append({"config": name, "target": r["target"], "occupancy": r["occupancy"],
                        "hit_vs_full": None if not h else r["hit_ratio"] / h,
                        "concurrency_vs_full": None if not c else r["concurrency"] / c})
    return out


def plot(rows: List[Dict[str, Any]], names: List[str], path: str, kv_gib: float) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'pagedkv[plot]')")
        return
    labels = {"groups": "pagedkv, 31 groups of 2 layers", "full": "counted as full attention",
              "vllm": "vLLM 0.33 KVCacheManager, its grouping"}
    fig = Figure(figsize=(10, 4.2))
    FigureCanvasAgg(fig)
    a1, a2 = fig.subplots(1, 2)
    for name in names:
        rs = sorted((r for r in rows if r["config"] == name), key=lambda r: r["occupancy"])
        occ = [100 * r["occupancy"] for r in rs]
        label = labels.get(name, f"pagedkv groups, {name[7:]} full accounting's concurrency")
        a1.plot(occ, [100 * r["hit_ratio"] for r in rs], marker="o", label=label)
        a2.plot(occ, [r["concurrency"] for r in rs], marker="o", label=label)
    a1.set_xlabel("pool occupancy by running sequences (%)")
    a1.set_ylabel("prefix hit ratio (%)")
    a1.set_ylim(0, 100)
    a2.set_xlabel("pool occupancy by running sequences (%)")
    a2.set_ylabel("concurrent sequences")
    a1.legend(fontsize=8)
    fig.suptitle(f"Gemma-3-27B-shaped chat trace, {kv_gib:g} GiB of KV (CPU, bookkeeping only)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
