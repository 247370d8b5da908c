import sys, numpy as np, torch, transformers
sys.path.insert(0, "tests")
import test_engine_groups as T
from pagedkv import LLM, SamplingParams
from pagedkv.layer_groups import group_layers, layer_kinds
from pagedkv.engine.builder import sequence_blocks
import tempfile

def worst_gap(kind, dtype, topk=None, graphs=True, sinks=True, preempt=True):
    torch.manual_seed(7)
    cfg = T._gpu_config(kind)
    if topk: cfg.num_experts_per_tok = topk
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name:
                p.normal_(0.0, 0.5) if sinks else p.fill_(-30.0)
    d = tempfile.mkdtemp(); model.save_pretrained(d)
    g = np.random.default_rng(3)
    shared = g.integers(0, 1024, 40).tolist()
    prompts = [shared + g.integers(0, 1024, n).tolist() for n in (5, 120, 37, 1, 150, 73)]
    new = 40
    params = [SamplingParams(temperature=0.0, max_tokens=new, n=2 if i % 3 == 0 else 1, ignore_eos=True) for i in range(len(prompts))]
    grouping = group_layers(layer_kinds(cfg), 1024, 16)
    peak = sequence_blocks(grouping.groups, 190 + new, 16, 128)
    nb = peak + 8 if preempt else 4 * peak
    llm = LLM(d, device="cuda", dtype=dtype, block_size=16, num_blocks=nb, max_num_seqs=8, max_num_batched_tokens=128, progress=False, cuda_graphs=graphs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    st = llm.stats()
    dense = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to("cuda").eval()
    worst = 0.0; where = None
    for pi, (p, o) in enumerate(zip(prompts, outs)):
        for c in o.outputs:
            ids = torch.tensor([p + c.token_ids], device="cuda")
            with torch.no_grad():
                lp = torch.log_softmax(dense(ids).logits[0].float(), -1)
            pos = torch.arange(len(p) - 1, len(p) - 1 + new, device="cuda")
            chosen = lp[pos, torch.tensor(c.token_ids, device="cuda")]
            gaps = lp[pos].max(-1).values - chosen
            if gaps.max().item() > worst:
                worst = gaps.max().item(); where = (pi, int(gaps.argmax()))
    llm.shutdown()
    print(f"{kind} dtype={dtype} topk={topk} graphs={graphs} sinks={sinks} preempt={preempt}: worst {worst:.4f} at {where} preemptions {st.num_preemptions}", flush=True)

import traceback
try:
    worst_gap("gpt_oss", dtype=torch.float32, graphs=False)
except Exception:
    traceback.print_exc()
try:
    worst_gap("gpt_oss", dtype=torch.float32, graphs=True)
except Exception:
    print(traceback.format_exc()[-2500:])
