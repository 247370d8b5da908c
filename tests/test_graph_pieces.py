"""A decode step captured as several CUDA graphs of consecutive layers (``capture_graphs(pieces=)``).

``gpu``: the pieces run the same kernels on the same buffers as the one-graph step, so every
decode step's logits are bitwise equal to it (bf16, fused forward), at a batch that fills its
graph and one that pads it; the unfused forward ignores ``pieces`` (one graph per size).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pagedkv.engine.model_runner import ModelRunner  # noqa: E402
from test_fused import _drive, _loaded, _model  # noqa: E402


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
    runner = ModelRunner(_loaded(model), cuda_graphs=False, **kw)
    runner.capture_graphs(pieces=pieces)
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
