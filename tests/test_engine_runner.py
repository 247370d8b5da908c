"""The model runner against transformers' own dense forward and ``generate``.

Small random-initialised Llama and Qwen2 models (fp32, seeded) are saved with ``save_pretrained``
and reloaded through :func:`pagedkv.engine.loader.load_model`; a real :class:`pagedkv.BlockManager`
drives the runner directly (admit, append, fork, step). Every step's logits are compared with
``model(full_sequence).logits`` at the same position (the dense forward, no cache), within 1e-4, and
greedy continuations with ``model.generate(do_sample=False)``. Covered: a ragged prompt batch,
prefill in chunks mixed with decodes, decode steps, a prefix-cache hit (the second request computes
only its uncached tokens), a fork whose first writes copy the shared tail block (copy-on-write).
The SmolLM2 GGUF test is ``slow`` (loading and dequantizing takes ~20 s on 2 cores); the ``gpu``
tests compare bf16 runs under teacher forcing and CUDA-graph decode with eager decode.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv.errors import InvalidArgumentError, ModelLoadError  # noqa: E402
from pagedkv.engine.loader import default_model_path, load_model  # noqa: E402
from pagedkv.engine.model_runner import ModelRunner, graph_batch_sizes  # noqa: E402
from pagedkv.engine.core import build_block_manager  # noqa: E402

ATOL = 1e-4
BLOCK = 4


def _tiny_config(kind: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(use_sliding_window=False, **common)


def _save_tiny(kind: str, directory: str) -> str:
    torch.manual_seed(1234)
    cfg = _tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # Qwen2's Q/K/V biases start at zero; make them matter
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, tmp_path_factory):
    path = _save_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    return load_model(path, device="cpu")


class Driver:
    """Drives a runner with a real manager; tracks each sequence's tokens and computed count."""

    def __init__(self, runner: ModelRunner, **manager_kwargs):
        self.runner = runner
        self.mgr = build_block_manager(runner, **manager_kwargs)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def admit(self, sid, tokens):
        res = self.mgr.admit(sid, list(tokens))
        self.tokens[sid] = list(tokens)
        self.computed[sid] = res.cached_tokens
        return res

    def append(self, sid, tokens):
        self.mgr.append(sid, list(tokens))
        self.tokens[sid] += list(tokens)

    def fork(self, parent, child):
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]

    def step(self, sids):
        new = [len(self.tokens[s]) - self.computed[s] for s in sids]
        info = self.mgr.step(sids, new)
        ids = np.concatenate([self.tokens[s][self.computed[s]:] for s in sids]).astype(np.int64)
        pos = np.concatenate([np.arange(self.computed[s], len(self.tokens[s])) for s in sids])
        logits = self.runner.execute(ids, pos, info, list(range(len(sids))))
        for s in sids:
            self.computed[s] = len(self.tokens[s])
        return logits, info


def dense_last_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def check_against_dense(loaded, driver, sids, logits):
    assert logits.dtype == torch.float32
    assert logits.shape == (len(sids), loaded.config.vocab_size)
    for k, s in enumerate(sids):
        ref = dense_last_logits(loaded.model, driver.tokens[s])
        torch.testing.assert_close(logits[k], ref, atol=ATOL, rtol=0)


def _runner(loaded, **kw):
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 96)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return ModelRunner(loaded, **kw)


def _prompts(seed, lengths):
    g = np.random.default_rng(seed)
    return [g.integers(0, 128, n).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------


def test_ragged_prefill_then_decode_matches_dense(loaded):
    d = Driver(_runner(loaded))
    prompts = _prompts(0, [5, 13, 1, 8])
    sids = [10, 11, 12, 13]
    for s, p in zip(sids, prompts):
        d.admit(s, p)
    logits, info = d.step(sids)
    assert info.num_tokens == sum(map(len, prompts))
    check_against_dense(loaded, d, sids, logits)
    for _ in range(6):  # decode steps, greedy
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(sids, nxt):
            d.append(s, [t])
        logits, info = d.step(sids)
        assert info.num_tokens == len(sids)
        check_against_dense(loaded, d, sids, logits)
    d.mgr.check_invariants()


def test_chunked_prefill_mixed_with_decodes_matches_dense(loaded):
    d = Driver(_runner(loaded))
    long_prompt = _prompts(1, [23])[0]
    short = _prompts(2, [6])[0]
    d.admit(0, short)
    logits, _ = d.step([0])
    check_against_dense(loaded, d, [0], logits)
    # The long prompt arrives in chunks of 8 while sequence 0 keeps decoding: mixed steps.
    d.admit(1, long_prompt[:8])
    fed = 8
    while True:
        d.append(0, [int(logits[0].argmax())])
        logits, info = d.step([0, 1])
        assert info.num_tokens == 1 + (8 if fed <= 8 or fed % 8 == 0 else fed % 8)
        check_against_dense(loaded, d, [0, 1], logits)
        if fed >= len(long_prompt):
            break
        chunk = long_prompt[fed:fed + 8]
        d.append(1, chunk)
        fed += len(chunk)
        logits = logits[:1]
    assert d.tokens[1] == long_prompt


def test_greedy_equals_generate(loaded):
    d = Driver(_runner(loaded))
    prompts = _prompts(3, [7, 3, 12])
    sids = [0, 1, 2]
    new_tokens = 10
    for s, p in zip(sids, prompts):
        d.admit(s, p)
    out = {s: [] for s in sids}
    logits, _ = d.step(sids)
    for _ in range(new_tokens):
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(sids, nxt):
            out[s].append(t)
        if len(out[0]) == new_tokens:
            break
        for s, t in zip(sids, nxt):
            d.append(s, [t])
        logits, _ = d.step(sids)
    for s, p in zip(sids, prompts):
        with torch.no_grad():
            ref = loaded.model.generate(torch.tensor([p]), do_sample=False,
                                        max_new_tokens=new_tokens, eos_token_id=None,
                                        pad_token_id=0)
        assert out[s] == ref[0, len(p):].tolist()


def test_prefix_hit_skips_cached_tokens(loaded):
    d = Driver(_runner(loaded))
    shared = _prompts(4, [10])[0]
    a = shared + [3, 4]
    b = shared + [9, 8, 7]
    d.admit(0, a)
    logits, _ = d.step([0])
    check_against_dense(loaded, d, [0], logits)
    res = d.admit(1, b)
    # Two full blocks of 4 (8 tokens) are cached; only the rest is computed.
    assert res.cached_tokens == 8
    logits, info = d.step([1])
    assert info.num_tokens == len(b) - 8
    check_against_dense(loaded, d, [1], logits)
    d.append(1, [int(logits[0].argmax())])
    logits, _ = d.step([1])
    check_against_dense(loaded, d, [1], logits)


def test_fork_copy_on_write(loaded):
    d = Driver(_runner(loaded))
    prompt = _prompts(5, [10])[0]  # 2 full blocks + a partial tail block of 2
    d.admit(0, prompt)
    logits, _ = d.step([0])
    first = int(logits[0].argmax())
    d.fork(0, 1)
    d.fork(0, 2)
    # The children diverge at their first sampled token: each write lands in the shared tail
    # block, so the writers get private copies and the copy list reaches the runner.
    d.append(0, [first])
    d.append(1, [(first + 1) % 128])
    d.append(2, [(first + 2) % 128])
    logits, info = d.step([0, 1, 2])
    assert info.num_copies >= 2
    check_against_dense(loaded, d, [0, 1, 2], logits)
    tails = {d.mgr.block_table(s)[-1] for s in (0, 1, 2)}
    assert len(tails) == 3
    for _ in range(4):
        for k, s in enumerate((0, 1, 2)):
            d.append(s, [int(logits[k].argmax())])
        logits, _ = d.step([0, 1, 2])
        check_against_dense(loaded, d, [0, 1, 2], logits)
    d.mgr.check_invariants()


def test_sample_rows_select_and_order(loaded):
    d = Driver(_runner(loaded))
    prompts = _prompts(6, [4, 9, 2])
    for s, p in enumerate(prompts):
        d.admit(s, p)
    new = [len(p) for p in prompts]
    info = d.mgr.step([0, 1, 2], new)
    ids = np.concatenate(prompts)
    pos = np.concatenate([np.arange(n) for n in new])
    logits = d.runner.execute(ids, pos, info, [2, 0])
    assert logits.shape == (2, 128)
    torch.testing.assert_close(logits[0], dense_last_logits(loaded.model, prompts[2]), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(logits[1], dense_last_logits(loaded.model, prompts[0]), atol=ATOL,
                               rtol=0)


def test_model_still_generates_densely_after_runner_steps(loaded):
    d = Driver(_runner(loaded))
    d.admit(0, [1, 2, 3])
    d.step([0])
    # The runner routes attention to pagedkv only during a step.
    assert loaded.model.config._attn_implementation != "pagedkv"
    ref = dense_last_logits(loaded.model, [1, 2, 3])
    assert torch.isfinite(ref).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                    reason="the kernel path on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("planner", [True, False])
def test_kernel_path_interpreted_matches_dense(loaded, planner):
    # The CUDA path's attention (scatter_kv, paged_prefill for mixed steps, paged_decode for
    # pure decode steps, planned from the real lengths or by the split heuristic), run by
    # Triton's interpreter on CPU tensors.
    d = Driver(_runner(loaded, attention_backend="triton", decode_planner=planner))
    assert d.runner.use_kernels
    assert (d.runner.decode_plan is not None) == planner
    if planner:
        # Chunks of 4 tokens: every sequence is split, so the merge path runs too.
        from pagedkv.decode_plan import DecodePlan

        p = d.runner.decode_plan
        d.runner.decode_plan = DecodePlan(p.max_num_seqs, p.num_q_heads, p.num_kv_heads,
                                          p.head_dim, device="cpu", min_chunk=4)
    prompts = _prompts(7, [6, 11])
    d.admit(0, prompts[0])
    d.admit(1, prompts[1][:4])
    logits, _ = d.step([0, 1])
    check_against_dense(loaded, d, [0, 1], logits)
    d.append(0, [int(logits[0].argmax())])
    d.append(1, prompts[1][4:])
    logits, _ = d.step([0, 1])  # mixed: a decode row and a prefill chunk
    check_against_dense(loaded, d, [0, 1], logits)
    d.fork(1, 2)
    for _ in range(2):  # pure decode, with a copy-on-write on the first
        for k, s in enumerate((0, 1)):
            d.append(s, [int(logits[k].argmax())])
        d.append(2, [int(logits[1].argmax() + 1) % 128])
        logits, info = d.step([0, 1, 2])
        assert info.num_tokens == 3
        check_against_dense(loaded, d, [0, 1, 2], logits)
        if planner:
            assert d.runner.decode_plan.num_seqs == 3 and d.runner.decode_plan.num_items > 3
        logits = logits[:2]


# ------------------------------------------------------------------------------- bad input


def test_execute_rejects_bad_input_without_touching_the_pool(loaded):
    d = Driver(_runner(loaded))
    d.admit(0, [1, 2, 3, 4, 5])
    info = d.mgr.step([0], [5])
    before = d.runner.pool.kv.clone()
    ids, pos = np.arange(5), np.arange(5)
    with pytest.raises(InvalidArgumentError):
        d.runner.execute(ids[:4], pos[:4], info, [0])
    with pytest.raises(InvalidArgumentError):
        d.runner.execute(ids, pos, info, [1])
    with pytest.raises(InvalidArgumentError):
        d.runner.execute(ids + 1000, pos, info, [0])
    with pytest.raises(InvalidArgumentError):
        d.runner.execute(ids, pos + 10_000, info, [0])
    with pytest.raises(InvalidArgumentError):
        d.runner.execute(np.zeros((5, 1)), pos, info, [0])
    assert torch.equal(before, d.runner.pool.kv)


def test_runner_config_errors(loaded):
    with pytest.raises(InvalidArgumentError):
        ModelRunner(loaded, num_blocks=8, kv_cache_memory=2**20)
    with pytest.raises(InvalidArgumentError):
        ModelRunner(loaded, num_blocks=0)
    with pytest.raises(InvalidArgumentError):
        ModelRunner(loaded, block_size=0, num_blocks=8)
    from pagedkv.config import CapacityError

    with pytest.raises(CapacityError):
        ModelRunner(loaded, kv_cache_memory=10)
    r = ModelRunner(loaded, kv_cache_memory="1MiB", block_size=4, max_num_seqs=4)
    assert r.num_blocks == 2**20 // r.spec.bytes_per_block
    assert r.pool.nbytes == r.num_blocks * r.spec.bytes_per_block


def test_loader_errors(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path), device="cpu")  # a directory without config.json
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(tmp_path / "gpt2"), device="cpu")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "w.bin"), device="cpu")
    with pytest.raises(InvalidArgumentError):
        load_model(str(tmp_path / "gpt2"), device="cpu", dtype="int3")


def test_loaded_model_fields(loaded):
    assert loaded.max_model_len == 256
    assert loaded.tokenizer is None
    assert loaded.model.training is False
    assert loaded.dtype == torch.float32


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(256)[:8] == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(100)[-1] == 100


def test_default_model_path_points_at_the_gguf():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


# ------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
def test_smollm2_greedy_equals_generate():
    loaded = load_model(default_model_path(), device="cpu")
    assert loaded.config.model_type == "llama"
    tok = loaded.tokenizer
    prompts = [tok.encode("The capital of France is"),
               tok.encode("def fibonacci(n):\n    ")]
    runner = ModelRunner(loaded, block_size=16, num_blocks=64, max_num_seqs=4,
                         max_num_batched_tokens=128)
    d = Driver(runner)
    new_tokens = 12
    for s, p in enumerate(prompts):
        d.admit(s, p)
    out = {0: [], 1: []}
    logits, _ = d.step([0, 1])
    while True:
        nxt = logits.argmax(-1).tolist()
        for s, t in enumerate(nxt):
            out[s].append(t)
        if len(out[0]) == new_tokens:
            break
        for s, t in enumerate(nxt):
            d.append(s, [t])
        logits, _ = d.step([0, 1])
    for s, p in enumerate(prompts):
        with torch.no_grad():
            ref = loaded.model.generate(torch.tensor([p]), do_sample=False,
                                        max_new_tokens=new_tokens, eos_token_id=None,
                                        pad_token_id=0)
        assert out[s] == ref[0, len(p):].tolist()


# ---------------------------------------------------------------------------------------- GPU


def _gpu_model(tmp_path, dtype=torch.bfloat16):
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1024,
                                   initializer_range=0.05, eos_token_id=None, bos_token_id=None,
                                   pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(tmp_path))
    return load_model(str(tmp_path), device="cuda", dtype=dtype)


#: bf16 tolerance, stated against an fp32 dense forward of the same (bf16-rounded) weights: per
#: position, the largest |log-prob error| over the vocabulary. The runner's mean error may be at
#: most twice transformers' own bf16 dense error plus 0.01 (decode rows run their GEMMs at another
#: batch shape than the dense forward, so their rounding differs; the size is bf16's, not a bug's),
#: and no position may be off by more than BF16_LOGPROB_ATOL.
BF16_LOGPROB_ATOL = 0.15
BF16_MEAN_FACTOR = 2.0
BF16_MEAN_SLACK = 0.01


@pytest.mark.gpu
def test_gpu_bf16_teacher_forced_logprobs_match_dense(tmp_path):
    loaded = _gpu_model(tmp_path)
    runner = ModelRunner(loaded, block_size=16, num_blocks=256, max_num_seqs=16,
                         max_num_batched_tokens=512)
    d = Driver(runner)
    g = np.random.default_rng(0)
    seqs = [g.integers(0, 1024, n).tolist() for n in (37, 200, 5, 96)]
    prompt_lens = [20, 150, 3, 40]
    sids = list(range(len(seqs)))
    for s in sids:
        d.admit(s, seqs[s][:prompt_lens[s]])
    logits, _ = d.step(sids)
    got = {s: [logits[s]] for s in sids}
    # Teacher forcing: step i feeds the reference token at position P + i - 1, one per sequence,
    # until each sequence has a prediction for every position from P - 1 to N - 2.
    for i in range(1, max(len(seqs[s]) - prompt_lens[s] for s in sids)):
        live = [s for s in sids if i <= len(seqs[s]) - prompt_lens[s] - 1]
        for s in live:
            d.append(s, [seqs[s][prompt_lens[s] + i - 1]])
        logits, _ = d.step(live)
        for k, s in enumerate(live):
            got[s].append(logits[k])
    import copy

    fp32 = copy.deepcopy(loaded.model).float()
    err_runner, err_dense, diff_dense = [], [], []
    for s in sids:
        ids = torch.tensor([seqs[s]], device="cuda")
        n = len(got[s])
        window = slice(prompt_lens[s] - 1, prompt_lens[s] - 1 + n)
        with torch.no_grad():
            lp32 = torch.log_softmax(fp32(ids).logits[0, window].float(), -1)
            lp16 = torch.log_softmax(loaded.model(ids).logits[0, window].float(), -1)
        lp = torch.log_softmax(torch.stack(got[s]), -1)
        err_runner.append((lp - lp32).abs().max(-1).values)
        err_dense.append((lp16 - lp32).abs().max(-1).values)
        diff_dense.append((lp - lp16).abs().max(-1).values)
    er, ed, dd = torch.cat(err_runner), torch.cat(err_dense), torch.cat(diff_dense)
    print(f"bf16 teacher forcing over {er.numel()} positions, max |logprob error| per position "
          f"vs fp32 dense: runner mean {er.mean():.4f} max {er.max():.4f}; transformers bf16 "
          f"dense mean {ed.mean():.4f} max {ed.max():.4f}; runner vs bf16 dense mean "
          f"{dd.mean():.4f} max {dd.max():.4f}")
    assert er.max().item() < BF16_LOGPROB_ATOL
    assert dd.max().item() < BF16_LOGPROB_ATOL
    assert er.mean().item() <= BF16_MEAN_FACTOR * ed.mean().item() + BF16_MEAN_SLACK


#: Graph and eager decode run the same kernels; only the decode split count may differ (fixed from
#: max_model_len at capture, from the step's longest sequence in eager mode).
GRAPH_EAGER_ATOL = 0.1


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_equals_eager(tmp_path):
    loaded = _gpu_model(tmp_path)
    kw = dict(block_size=16, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)
    graphs = ModelRunner(loaded, cuda_graphs=True, **kw)
    eager = ModelRunner(loaded, cuda_graphs=False, **kw)
    assert graphs.graph_sizes == [1, 2, 4, 8] and eager.graph_sizes == []
    g = np.random.default_rng(1)
    prompts = [g.integers(0, 1024, n).tolist() for n in (33, 7, 120)]  # 3 rows: padded to 4
    drivers = [Driver(graphs), Driver(eager)]
    outs = []
    for d in drivers:
        sids = [0, 1, 2]
        for s, p in zip(sids, prompts):
            d.admit(s, p)
        logits, _ = d.step(sids)
        seq_logits = []
        for i in range(12):
            for s in sids:
                d.append(s, [(i * 37 + s) % 1024])
            logits, _ = d.step(sids)
            seq_logits.append(logits)
        # Drop one sequence: a batch of 2 replays the size-2 graph.
        d.mgr.free(2)
        for i in range(4):
            for s in (0, 1):
                d.append(s, [(i * 11 + s) % 1024])
            logits, _ = d.step([0, 1])
            seq_logits.append(logits)
        outs.append(seq_logits)
    for a, b in zip(*outs):
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        assert (la - lb).abs().max().item() < GRAPH_EAGER_ATOL
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_forward_that_cannot_be_captured_is_refused_with_the_remedy():
    """A capture that fails (transformers' fp32 grouped-GEMM experts copy from host memory inside
    the graph, seen on an H100 with gpt-oss) becomes a typed error naming ``cuda_graphs=False``;
    a capture that works runs once with the pieces asked for."""
    from pagedkv.engine.model_runner import capture_or_refuse
    from pagedkv.errors import InvalidConfigError

    def broken(pieces):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                           "unless the CPU tensor is pinned.\nsecond line")

    with pytest.raises(InvalidConfigError) as info:
        capture_or_refuse(broken, 1)
    assert info.value.field == "cuda_graphs"
    assert "cuda_graphs=False" in str(info.value) and "Cannot copy" in str(info.value)
    assert "second line" not in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    seen = []
    capture_or_refuse(lambda pieces: seen.append(pieces), 3)
    assert seen == [3]
