"""Speculative decoding's system cost, isolated from any model's acceptance: an oracle proposer.

Random weights give no honest acceptance rate, so the drafts come from an *oracle*: the greedy
continuation a plain run produced for the same prompt (on a random model made decisive,
:func:`make_decisive`, so that continuation does not hinge on bf16 rounding), each draft token kept with probability
``alpha`` and replaced by a wrong token otherwise (drafts after a wrong one are rejected anyway; the
oracle still proposes ``k`` so each verify pass costs what a real proposer's would). What is
measured is then the engine: one target forward over ``k + 1`` positions per sequence, the
commit/rewind of provisional slots, rejection bookkeeping and the cost model's switch-off.

At each batch size of ``--batches`` (``--requests-per-slot`` times as many random prompts of
``--prompt`` tokens, ``--new`` greedy tokens each, through ``max_num_seqs`` = the batch size), in
one run: plain decoding, then speculation at ``k = --k`` for each ``alpha`` of
``--alphas``. The decode rate is ``requests * (new - 1)`` over the run's time less the time of the
same prompts at ``max_tokens=1`` (prefill and the first token). Reported per setting: decode
tokens/s, the speedup over plain, the mean accepted length per drafted pass against the expected
``(1 - alpha^(k+1)) / (1 - alpha)``, the verify step's time, the *ideal* speedup (expected tokens
per pass over the verify pass's cost, against the plain step) and the share of it reached; the
same for the drafts actually sent (the cost model may send fewer than ``k`` a pass: ``drafted``
is their mean, ``ideal d`` the ideal for that many); steps the cost model sent undrafted, and whether the outputs equal plain decoding's.

With one request per slot the batch is closed: it drains as its sequences finish, and the slowest
sequence's passes set the run's length, which a speculative run feels more than a plain one (its
sequences finish after different numbers of passes). With several per slot a finished sequence's
slot takes the next waiting request at once, as in serving, and only the last wave drains. With
every output ``--new`` tokens long a plain run's sequences finish in the same step, so only the
speculative run drains at all; ``--ragged`` draws each request's length from ``[new / 2, 3 new /
2]``, as a served mix is, and both runs drain (the decode rate counts every generated token after
each request's first).

Defaults: Llama-3-8B dimensions with random bf16 weights on CUDA (``benches/_dims.py``). A CPU
smoke run: ``--device cpu --dtype float32 --layers 2 --hidden 256 --heads 4 --kv-heads 2 --mlp 512
--vocab 1024 --prompt 64 --new 32 --batches 1,4``.

Usage (repository root): ``PYTHONPATH=python python3 benches/bench_spec_oracle.py [--batches
1,8,64] [--alphas 0.5,0.7,0.9] [--k 4] [--json out.json]``. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np

import _dims


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def expected_length(alpha: float, k: int) -> float:
    """Tokens one drafted pass yields in expectation: ``1 + alpha + ... + alpha^k``."""
    return float(sum(alpha ** j for j in range(k + 1)))


def make_oracle(refs: Dict[tuple, List[int]], prompt_len: int, alpha: float, k: int, vocab: int,
                seed: int) -> Any:
    """An oracle :class:`~pagedkv.engine.spec_decode.base.Proposer` replaying ``refs`` (prompt ->
    plain greedy output)."""
    from pagedkv.engine.spec_decode.base import Drafts, Proposer
    from pagedkv.engine.spec_decode.config import SpeculativeConfig

    class Oracle(Proposer):
        method = "oracle"

        def propose(self, token_ids: Sequence[Sequence[int]],
                    limits: Sequence[int]) -> Drafts:
            out: List[List[int]] = []
            k = self.config.num_speculative_tokens
            for ids, limit in zip(token_ids, limits):
                ref = refs.get(tuple(ids[:prompt_len]), [])
                g = len(ids) - prompt_len  # tokens generated so far: the next is ref[g]
                rng = random.Random(hash((seed, tuple(ids[:8]), g)))
                d = []
                for j in range(min(k, limit)):
                    if g + j >= len(ref):
                        break
                    t = ref[g + j]
                    d.append(t if rng.random() < alpha else (t + 1) % vocab)
                out.append(d)
            return Drafts(out)

    return Oracle(SpeculativeConfig(num_speculative_tokens=k), vocab)


def make_decisive(model: Any, seed: int = 0) -> None:
    """Gives a random model a greedy continuation that bf16 rounding cannot change.

    A random model's top two logits are closer than bf16 rounding, so the verify pass (several
    tokens a sequence) and plain decoding (one) pick different tokens within a few steps, and an
    oracle replaying the plain run then proposes nothing the target accepts. Here every layer's
    writes into the residual stream (attention and MLP output projections) are scaled by 1e-4 and
    the LM head is the embedding under a random permutation ``p``: the last hidden state stays
    close to the last token's embedding, so the next token is ``p(last)`` by a wide margin. Every
    layer still runs at its full size, so the passes cost what the random model's do."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-4)
            layer.mlp.down_proj.weight.mul_(1e-4)
        emb = model.model.embed_tokens.weight
        if model.lm_head.weight.data_ptr() == emb.data_ptr():
            raise ValueError("make_decisive needs an LM head apart from the embedding")
        perm = torch.randperm(emb.shape[0], generator=g).to(emb.device)
        # lm_head[v] = embedding[p^-1(v)]: the row of token t's embedding sits at p(t).
        model.lm_head.weight[perm] = emb


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import transformers

    import pagedkv
    from pagedkv.engine.loader import LoadedModel

    dims = _dims.model_dims(args)
    cfg = _dims.llama_config(dims, args.max_model_len)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    make_decisive(model)
    loaded = LoadedModel(model=model, tokenizer=None, config=model.config,
                         max_model_len=args.max_model_len, eos_token_ids=[], path="random")
    vocab = dims["vocab"]
    rows: List[Dict[str, Any]] = []

    def make(spec: Any, batch: int) -> Any:
        if args.device == "cuda":
            torch.cuda.empty_cache()
        blocks = batch * (-(-(args.prompt + args.new + args.k + 1) // 16)) + 64
        return pagedkv.LLM(loaded, device=args.device, num_blocks=blocks, block_size=16,
                           max_num_seqs=max(batch, 1), max_num_batched_tokens=args.chunk,
                           enable_prefix_caching=False, progress=False, speculative_config=spec)

    def timed(llm: Any, prompts: List[List[int]], n: Any) -> tuple:
        lengths = n if isinstance(n, list) else [n] * len(prompts)
        params = [pagedkv.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in lengths]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    for batch in args.batches:
        g = np.random.default_rng(batch)
        requests = batch * args.requests_per_slot
        prompts = [g.integers(0, vocab, args.prompt).tolist() for _ in range(requests)]
        # Output lengths: all --new, or with --ragged drawn from [new / 2, 3 new / 2] (mean new).
        new = [args.new] * requests
        if args.ragged:
            new = g.integers(args.new // 2, args.new * 3 // 2 + 1, requests).tolist()
        decoded = sum(new) - requests  # the tokens after each request's first
        plain = make(None, batch)
        timed(plain, prompts[:1], 4)  # warm-up
        s0 = plain.stats().num_steps
        t_full, ref = timed(plain, prompts, new)
        steps_plain = plain.stats().num_steps - s0
        t_first, _ = timed(plain, prompts, 1)
        plain.shutdown()
        dec_plain = max(t_full - t_first, 1e-9)
        rate_plain = decoded / dec_plain
        step_plain = dec_plain / max(steps_plain - 1, 1)
        rows.append({"batch": batch, "requests": requests, "alpha": None,
                     "tokens_per_s": rate_plain, "speedup": 1.0,
                     "step_ms": step_plain * 1e3, "identical": True})
        refs = {tuple(p): r for p, r in zip(prompts, ref)}
        for alpha in args.alphas:
            spec = {"method": "ngram", "num_speculative_tokens": args.k}
            llm = make(spec, batch)
            timed(llm, prompts[:1], 4)  # warm-up (no drafts: the oracle is not in yet)
            llm.llm_engine.core.proposer = make_oracle(refs, args.prompt, alpha, args.k, vocab,
                                                          seed=1)
            st0 = llm.stats()
            t_full, outs = timed(llm, prompts, new)
            st = llm.stats()
            t_first, _ = timed(llm, prompts, 1)
            llm.shutdown()
            steps = st.num_steps - st0.num_steps
            drafts = st.spec_num_drafts - st0.spec_num_drafts
            accepted = st.spec_num_accepted_tokens - st0.spec_num_accepted_tokens
            skipped = st.spec_num_steps_skipped - st0.spec_num_steps_skipped
            dec = max(t_full - t_first, 1e-9)
            rate = decoded / dec
            step = dec / max(steps - 1, 1)
            exp = expected_length(alpha, args.k)
            ideal = exp * step_plain / step
            # The cost model may send fewer than k drafts a pass (it prices the verify pass):
            # the ideal for what was actually drafted, d tokens a pass on average.
            d = (st.spec_num_draft_tokens - st0.spec_num_draft_tokens) / drafts if drafts else 0.0
            ideal_sent = (1 - alpha ** (d + 1)) / (1 - alpha) * step_plain / step
            rows.append({
                "batch": batch, "requests": requests, "alpha": alpha, "tokens_per_s": rate,
                "speedup": rate / rate_plain,
                "mean_accepted_length": 1.0 + accepted / drafts if drafts else 1.0,
                "expected_length": exp, "step_ms": step * 1e3, "ideal_speedup": ideal,
                "share_of_ideal": (rate / rate_plain) / ideal, "steps_skipped": skipped,
                "mean_drafted": d, "ideal_speedup_drafted": ideal_sent,
                "share_of_ideal_drafted": (rate / rate_plain) / ideal_sent,
                "identical": outs == ref,
            })
    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    return {"device": dev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "dims": dims, "k": args.k, "requests_per_slot": args.requests_per_slot,
            "ragged": bool(args.ragged),
            "prompt": args.prompt, "new": args.new, "rows": rows}


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _dims.add_model_args(ap)
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64])
    ap.add_argument("--alphas", type=_floats, default=[0.5, 0.7, 0.9])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests-per-slot", type=int, default=1,
                    help="requests per batch slot: 1 = a closed batch; more keep the batch full")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ragged", action="store_true",
                    help="output lengths drawn from [new / 2, 3 new / 2] per request (default: all "
                         "--new, so a plain run's sequences finish together)")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(list(argv) or None)
    r = run(args)
    print(f"device {r['device']}, {r['date']}; k = {r['k']}, prompt {r['prompt']}, "
          f"{r['new']} new tokens{' (ragged: new / 2 to 3 new / 2)' if r['ragged'] else ''}, "
          f"{r['requests_per_slot']} request(s) per slot, "
          f"dims {r['dims']}")
    print(f"{'batch':>5} {'alpha':>5} {'tok/s':>9} {'speedup':>7} {'accepted':>8} {'expected':>8} "
          f"{'step ms':>8} {'ideal':>6} {'share':>6} {'skipped':>7} {'drafted':>7} "
          f"{'ideal d':>7} {'share d':>7} identical")
    for x in r["rows"]:
        if x["alpha"] is None:
            print(f"{x['batch']:>5} {'-':>5} {x['tokens_per_s']:>9.1f} {1.0:>7.2f} {'-':>8} "
                  f"{'-':>8} {x['step_ms']:>8.2f} {'-':>6} {'-':>6} {'-':>7} -")
        else:
            print(f"{x['batch']:>5} {x['alpha']:>5.2f} {x['tokens_per_s']:>9.1f} "
                  f"{x['speedup']:>7.2f} {x['mean_accepted_length']:>8.2f} "
                  f"{x['expected_length']:>8.2f} {x['step_ms']:>8.2f} {x['ideal_speedup']:>6.2f} "
                  f"{x['share_of_ideal']:>6.2f} {x['steps_skipped']:>7} "
                  f"{x['mean_drafted']:>7.2f} {x['ideal_speedup_drafted']:>7.2f} "
                  f"{x['share_of_ideal_drafted']:>7.2f} {x['identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
