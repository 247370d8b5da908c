"""The fused forward (:mod:`pagedkv.engine.fused`) and its element-wise kernels.

CPU (fp32): a runner on the fused forward against one on the model's own forward, step by step
(logits within 1e-5, the same greedy tokens), for Llama and Qwen2 (Q/K/V biases); ``LLM.generate``
greedy outputs with ``fused_model`` on and off; the fused weights are views of the originals (no
copy, the model's own forward unchanged); models the fused forward cannot run are left alone.
Under ``TRITON_INTERPRET=1``: each Triton kernel against its PyTorch reference on small shapes,
fp32 and bf16 (in bf16 within two units in the last place: Triton's interpreter truncates where
compiled code rounds to nearest); the kernels' runner against the dense model, its one-row linear
layers through the GEMV and larger ones through cuBLAS (counted). ``gpu``: the kernels compiled
against the references (bf16, within one unit in the last place), and the fused forward in CUDA
graphs and eager against the unfused one in bf16.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedkv.engine import fused  # noqa: E402
from pagedkv.engine.loader import LoadedModel  # noqa: E402
from pagedkv.engine.model_runner import ModelRunner  # noqa: E402
from pagedkv.engine.core import build_block_manager  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
VOCAB = 128


def _model(kind: str, seed: int = 3, **extra):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common.update(extra)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    else:
        cfg = transformers.Qwen2Config(use_sliding_window=False, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _loaded(model):
    return LoadedModel(model=model, tokenizer=None, config=model.config, max_model_len=256,
                       eos_token_ids=[], path="memory")


def _drive(runner, prompts, steps, feed=None):
    """Prefill every prompt in one step, then ``steps`` decode steps (greedy, or the tokens of
    ``feed``: another run's logits, teacher forcing); the logits of each step."""
    mgr = build_block_manager(runner, enable_prefix_caching=False)
    sids = list(range(len(prompts)))
    for s, p in zip(sids, prompts):
        mgr.admit(s, p)
    info = mgr.step(sids, [len(p) for p in prompts])
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    pos = np.concatenate([np.arange(len(p)) for p in prompts])
    out = [runner.execute(ids, pos, info, sids)]
    ctx = np.array([len(p) for p in prompts], dtype=np.int64)
    for _ in range(steps):
        src = out[-1] if feed is None else feed[len(out) - 1]
        toks = src.argmax(-1).cpu().numpy().astype(np.int64)
        mgr.append_batch(np.asarray(sids, dtype=np.int64), toks)
        info = mgr.step(sids, 1)
        out.append(runner.execute(toks, ctx.copy(), info, sids))
        ctx += 1
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_runner_equals_unfused(kind):
    model = _model(kind)
    kw = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    plain = ModelRunner(_loaded(model), fused_model=False, **kw)
    assert not plain.fused and not fused.is_fused(model)
    g = np.random.default_rng(0)
    prompts = [g.integers(0, VOCAB, n).tolist() for n in (9, 3, 14)]
    ref = _drive(plain, prompts, 6)
    fast = ModelRunner(_loaded(model), **kw)
    assert fast.fused and fused.is_fused(model)
    got = _drive(fast, prompts, 6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_fused_weights_are_views_and_the_model_forward_is_unchanged():
    model = _model("qwen2")
    ids = torch.tensor([[5, 9, 2, 77, 31]])
    before = model(ids).logits
    ref = copy.deepcopy(model)
    assert fused.fuse_model(model) and fused.fuse_model(model)  # idempotent
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        w, b = att._pagedkv_qkv
        assert att.q_proj.weight.data_ptr() == w.data_ptr()
        assert att.k_proj.weight.data_ptr() == w[att.q_proj.out_features:].data_ptr()
        assert att.v_proj.bias.data_ptr() == b[-att.v_proj.out_features:].data_ptr()
        gw, gb = mlp._pagedkv_gate_up
        assert gb is None and mlp.up_proj.weight.data_ptr() == gw[mlp.gate_proj.out_features:].data_ptr()
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), ref.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_a_model_moved_after_fusing_is_fused_again():
    model = _model("llama", seed=4)
    kw = dict(block_size=4, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32)
    assert ModelRunner(_loaded(model), **kw).fused
    model.half().float()  # every parameter replaced by a new tensor: the fused ones are stale
    assert not fused.is_fused(model)
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    ref = _drive(ModelRunner(_loaded(model), fused_model=False, **kw), prompts, 3)
    runner = ModelRunner(_loaded(model), **kw)
    assert runner.fused and fused.is_fused(model)
    att = model.model.layers[0].self_attn
    assert att.q_proj.weight.data_ptr() == att._pagedkv_qkv[0].data_ptr()
    for a, b in zip(_drive(runner, prompts, 3), ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_unfusable_models_are_left_alone():
    model = _model("llama", hidden_act="gelu")
    assert "gelu" in fused.fusable(model)
    assert not fused.fuse_model(model) and not fused.is_fused(model)
    runner = ModelRunner(_loaded(model), block_size=4, num_blocks=16, max_num_seqs=2,
                         max_num_batched_tokens=32)
    assert not runner.fused


def test_llm_generate_greedy_equal_with_and_without_fusion(tmp_path):
    import pagedkv
    from tiny_llama import save_tiny_llama

    path = save_tiny_llama(str(tmp_path / "m"), seed=11)
    g = np.random.default_rng(4)
    prompts = [g.integers(0, 64, n).tolist() for n in (4, 11, 7)]
    sp = pagedkv.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for on in (True, False):
        llm = pagedkv.LLM(path, device="cpu", num_blocks=64, block_size=4, max_num_seqs=4,
                          fused_model=on)
        assert llm.llm_engine.runner.fused is on
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1]


# ------------------------------------------------------------------------- Triton, interpreted


needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


def _tol(dtype, ulps: int = 2) -> float:
    """``ulps`` units in bf16's last place (relative), for values of order 1; fp32: 1e-6."""
    return ulps * 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, with_residual):
    from pagedkv.kernels import elementwise as ew

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    r = torch.randn(5, 48, generator=g).to(dtype) if with_residual else None
    y, s = ew.rms_norm(x, w, 1e-5, r)
    y_ref, s_ref = ew.rms_norm_ref(x, w, 1e-5, r)
    tol = _tol(dtype)
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    if with_residual:
        torch.testing.assert_close(s, s_ref, atol=tol, rtol=tol)
    else:
        assert s is None


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 24])  # the kernel, and the eager fallback
def test_rope_kernel_matches_reference(dtype, d):
    from pagedkv.kernels import elementwise as ew

    g = torch.Generator().manual_seed(1)
    t, hq, hkv = 6, 4, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    ang = torch.arange(t)[:, None].float() * torch.rand(d // 2, generator=g)[None, :]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    a, b = qkv.clone(), qkv.clone()
    ew.rope_(a, cos, sin, hq + hkv, d)
    ew.rope_ref_(b, cos, sin, hq + hkv, d)
    tol = _tol(dtype)
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert torch.equal(a[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # V untouched
    assert not torch.equal(a[:, : hq * d], qkv[:, : hq * d])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_reference(dtype):
    from pagedkv.kernels import elementwise as ew

    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    tol = _tol(dtype)
    torch.testing.assert_close(ew.silu_mul(x), ew.silu_mul_ref(x), atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("batch, cublas", [(1, False), (1, True), (2, False)])
def test_interpreted_fused_kernel_runner_matches_dense(batch, cublas, monkeypatch):
    """The kernels' runner (interpreted) against the dense model. By default every linear layer
    of one row runs the GEMV (a one-sequence decode step's projections and LM head, the down
    projection's with SiLU-times-up applied to its input; the prefill's LM head, which keeps one
    row) and every larger one cuBLAS; ``gemv_rows = 0`` (what the benches compare against) runs
    cuBLAS throughout."""
    from pagedkv.kernels import gemv as gemv_mod

    calls = []
    real = gemv_mod.linear_small_m
    monkeypatch.setattr(gemv_mod, "linear_small_m",
                        lambda x, *a, **k: calls.append((x.shape[0],
                                                         k.get("silu_mul_input", False)))
                        or real(x, *a, **k))
    model = _model("llama", seed=9)
    runner = ModelRunner(_loaded(model), block_size=4, num_blocks=64, max_num_seqs=4,
                         max_num_batched_tokens=64, attention_backend="triton")
    assert runner.fused and runner.gemv_rows == 1
    if cublas:
        runner.gemv_rows = 0
    prompts = [[3, 17, 99, 4, 5], [8, 1]][:batch]
    steps = 2
    logits = _drive(runner, prompts, steps)
    seqs = [list(p) for p in prompts]
    for step in logits[:-1]:
        for k in range(len(seqs)):
            seqs[k].append(int(step[k].argmax()))
    for k, s in enumerate(seqs):
        ref = model(torch.tensor([s])).logits[0, -1]
        torch.testing.assert_close(logits[-1][k], ref, atol=1e-4, rtol=0)
    layers = model.config.num_hidden_layers
    assert all(rows == 1 for rows, _ in calls)
    if batch == 1 and not cublas:
        # Each decode step: 4 projections a layer (one gated) and the LM head; the 5-token
        # prefill: its LM head only.
        assert len(calls) == steps * (4 * layers + 1) + 1
        assert sum(g for _, g in calls) == steps * layers
    else:
        assert calls == []


@needs_interpreter
def test_interpreted_one_row_step_keeping_no_row(monkeypatch):
    """A one-row step that samples no row: its projections run the GEMV, its LM head (no row)
    stays on cuBLAS instead of asking the GEMV for zero rows."""
    from pagedkv.kernels import gemv as gemv_mod

    calls = []
    real = gemv_mod.linear_small_m
    monkeypatch.setattr(gemv_mod, "linear_small_m",
                        lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    model = _model("llama", seed=9)
    runner = ModelRunner(_loaded(model), block_size=4, num_blocks=64, max_num_seqs=4,
                         max_num_batched_tokens=64, attention_backend="triton")
    mgr = build_block_manager(runner, enable_prefix_caching=False)
    mgr.admit(0, [3, 17, 99, 4, 5])
    runner.execute(np.array([3, 17, 99, 4, 5]), np.arange(5), mgr.step([0], [5]), [0])
    mgr.append_batch(np.array([0]), np.array([7]))
    calls.clear()
    out = runner.execute(np.array([7]), np.array([5]), mgr.step([0], 1), [])
    assert out.shape == (0, VOCAB)
    assert calls == [1] * (4 * model.config.num_hidden_layers)


def test_the_cpu_path_never_uses_the_gemv():
    runner = ModelRunner(_loaded(_model("llama")), block_size=4, num_blocks=16,
                         attention_backend="torch")
    assert runner.fused and runner.gemv_rows == 0
    plain = ModelRunner(_loaded(_model("llama")), block_size=4, num_blocks=16,
                        attention_backend="torch", fused_model=False)
    assert not plain.fused and plain.gemv_rows == 0


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_elementwise_kernels_match_references():
    from pagedkv.kernels import elementwise as ew

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(37, 4096, device="cuda", generator=g).to(bf)
    r = torch.randn(37, 4096, device="cuda", generator=g).to(bf)
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=g)).to(bf)
    y, s = ew.rms_norm(x, w, 1e-5, r)
    y_ref, s_ref = ew.rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, atol=_tol(bf, 1), rtol=_tol(bf, 1))
    assert (y != y_ref).float().mean().item() < 0.01
    t, hq, hkv, d = 37, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(bf)
    ang = torch.arange(t, device="cuda")[:, None].float() * torch.rand(d // 2, device="cuda",
                                                                        generator=g)[None, :]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    a, b = qkv.clone(), qkv.clone()
    ew.rope_(a, cos, sin, hq + hkv, d)
    ew.rope_ref_(b, cos, sin, hq + hkv, d)
    # Within one bf16 ulp (about a fifth of the values differ by one: the compiled kernel's
    # fp32 products are not always rounded where the eager ops round them).
    torch.testing.assert_close(a, b, atol=_tol(bf, 1), rtol=_tol(bf, 1))
    gu = torch.randn(37, 2 * 14336, device="cuda", generator=g).to(bf)
    torch.testing.assert_close(ew.silu_mul(gu), ew.silu_mul_ref(gu), atol=_tol(bf, 1),
                               rtol=_tol(bf, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_fused_equals_unfused_bf16(graphs):
    model = _model("llama", seed=5, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=1024, initializer_range=0.05).to(
        "cuda", torch.bfloat16)
    kw = dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=512,
              cuda_graphs=graphs)
    g = np.random.default_rng(2)
    prompts = [g.integers(0, 1024, n).tolist() for n in (40, 7, 130)]
    ref = _drive(ModelRunner(_loaded(model), fused_model=False, **kw), prompts, 10)
    runner = ModelRunner(_loaded(model), **kw)
    assert runner.fused and (runner.graph_sizes != []) is graphs
    got = _drive(runner, prompts, 10, feed=ref)
    agree = []
    for a, b in zip(got, ref):
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        # Same rounding points; only fp32 reduction order and GEMM shapes differ.
        assert (la - lb).abs().max().item() < 0.1
        agree.append((a.argmax(-1) == b.argmax(-1)).float())
    assert torch.cat(agree).mean().item() >= 0.9
