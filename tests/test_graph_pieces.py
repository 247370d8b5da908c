"""A decode step captured as several CUDA graphs of consecutive layers (``capture_graphs(pieces=)``).

CPU (fp32): the fused forward run as prologue, layer ranges and epilogue (the pieces' split, the
hidden state and residual handed from one range to the next) equals the whole forward at every
step, for one cut after each layer and for uneven cuts.
``gpu``: the pieces run the same kernels on the same buffers as the one-graph step, so every
decode step's logits are bitwise equal to it (bf16, fused forward), at a batch that fills its
graph and one that pads it; the unfused forward ignores ``pieces`` (one graph per size).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.engine import fused  # noqa: E402
from pagedkv.engine.model_runner import ModelRunner  # noqa: E402
from test_fused import _drive, _loaded, _model  # noqa: E402


@pytest.mark.parametrize("cuts", [(0, 1, 2, 3), (0, 2, 3), (0, 1, 3)])
def test_layer_ranges_compose_to_the_whole_forward(monkeypatch, cuts):
    model = _model("llama", seed=7, num_hidden_layers=3)
    kw = dict(block_size=4, num_blocks=64, max_num_seqs=3, max_num_batched_tokens=64)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7]]
    ref = _drive(ModelRunner(_loaded(model), **kw), prompts, 5)
    whole = fused.fused_forward

    def pieced(model, meta, ids, pos, keep):
        h, cos, sin = fused.fused_prologue(model, ids, pos)
        residual = None
        for a, b in zip(cuts[:-1], cuts[1:]):
            h, residual = fused.fused_layers(model, meta, h, residual, cos, sin, a, b)
        return fused.fused_epilogue(model, meta, h, residual, keep)

    monkeypatch.setattr(fused, "fused_forward", pieced)
    runner = ModelRunner(_loaded(model), **kw)
    assert runner.fused and fused.fused_forward is not whole
    for a, b in zip(_drive(runner, prompts, 5), ref):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [2, 3])
def test_gpu_graph_pieces_equal_one_graph(pieces):
    model = _model("llama", seed=6, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, num_hidden_layers=4).to(
        "cuda", torch.bfloat16)
    kw = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    g = np.random.default_rng(3)
    prompts = [g.integers(0, 512, n).tolist() for n in (33, 5, 70)]  # 3 rows: the size-4 graph
    one = ModelRunner(_loaded(model), **kw)
    ref = _drive(one, prompts, 8)
    del one
    runner = ModelRunner(_loaded(model), cuda_graph_pieces=pieces, **kw)
    assert runner.graph_sizes == [1, 2, 4]
    assert len(runner._graphs[4][0].graphs) == pieces
    for a, b in zip(_drive(runner, prompts, 8), ref):
        assert torch.equal(a, b)
    for a, b in zip(_drive(runner, prompts[:2], 4), _drive(ModelRunner(_loaded(model), **kw),
                                                            prompts[:2], 4)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_graph_pieces_ignored_by_the_unfused_forward():
    model = _model("llama", seed=6).to("cuda", torch.bfloat16)
    runner = ModelRunner(_loaded(model), fused_model=False, cuda_graphs=False, block_size=16,
                         num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)
    runner.capture_graphs(pieces=2)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g, _ in runner._graphs.values())
