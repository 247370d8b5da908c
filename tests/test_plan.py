"""The capacity planner: pool arithmetic and per-length rows, text and JSON output."""

import json

import pytest

from pagedkv.cli import main
from pagedkv.config import PRESETS, CacheSpec, CapacityError, MemoryBudget
from pagedkv.errors import InvalidConfigError
from pagedkv.capacity import format_plan, make_plan, parse_seq_lens, plan_json

GiB = 2**30


def test_rows_match_hand_arithmetic():
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
    budget = MemoryBudget(total_bytes=80 * GiB, weights_bytes=16 * GiB, activation_peak_bytes=2 * GiB,
                          graph_reserve_bytes=GiB, utilization=1.0)
    plan = make_plan(spec, budget, [1000, 4096, 8192], max_model_len=8192)
    # (80 − 16 − 2 − 1) GiB / 2 MiB per block.
    assert plan.num_blocks == 61 * 512 == 31232
    assert plan.token_capacity == 31232 * 16
    r1000, r4096, r8192 = plan.rows
    assert (r1000.blocks_per_seq, r1000.paged_max_seqs, r1000.paged_waste_tokens_per_seq) == (63, 31232 // 63, 8)
    assert r1000.contiguous_max_seqs == 31232 * 16 // 8192 == 61
    assert r1000.contiguous_waste_tokens_per_seq == 8192 - 1000
    assert (r4096.paged_max_seqs, r4096.paged_waste_tokens_per_seq) == (122, 0)
    assert r8192.paged_max_seqs == r8192.contiguous_max_seqs == 61
    assert r8192.ratio == 1.0
    assert r1000.ratio == pytest.approx(495 / 61)


def test_default_max_model_len_is_longest_seq_len():
    spec = PRESETS["qwen2.5-7b"].cache_spec()
    plan = make_plan(spec, MemoryBudget(total_bytes=24 * GiB, weights_bytes=PRESETS["qwen2.5-7b"].weight_bytes),
                     [512, 2048])
    assert plan.max_model_len == 2048
    assert plan.rows[1].contiguous_waste_tokens_per_seq == 0


def test_errors():
    spec = CacheSpec(2, 2, 64, "float16")
    budget = MemoryBudget(total_bytes=GiB)
    with pytest.raises(InvalidConfigError, match="exceeds max_model_len"):
        make_plan(spec, budget, [1024, 4096], max_model_len=2048)
    with pytest.raises(InvalidConfigError):
        make_plan(spec, budget, [])
    with pytest.raises(InvalidConfigError):
        make_plan(spec, budget, [0])
    with pytest.raises(InvalidConfigError):
        make_plan(spec, budget, [16], max_model_len=0)
    with pytest.raises(CapacityError):
        make_plan(spec, MemoryBudget(total_bytes=GiB, weights_bytes=GiB), [16])


def test_parse_seq_lens():
    assert parse_seq_lens("1024, 4k,32K") == [1024, 4096, 32768]
    for bad in ("", "abc", "1024,-5", "0", ",,"):
        with pytest.raises(InvalidConfigError):
            parse_seq_lens(bad)


def test_text_and_json_agree():
    spec = PRESETS["llama-3-8b"].cache_spec()
    plan = make_plan(spec, MemoryBudget(total_bytes=80 * GiB, weights_bytes=PRESETS["llama-3-8b"].weight_bytes),
                     [1024, 4096])
    text = format_plan(plan)
    obj = json.loads(plan_json(plan))
    assert obj["num_blocks"] == plan.num_blocks
    assert f"{plan.num_blocks:,}" in text
    assert "131,072 B" in text  # bytes per token
    assert obj["bytes_per_token"] == 131072
    assert obj["rows"][0]["paged_max_seqs"] == plan.num_blocks // 64
    assert obj["rows"][0]["contiguous_max_seqs"] == plan.token_capacity // 4096


def test_cli_plan_json_numbers(capsys):
    rc = main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
               "--gpu-mem", "80GB", "--weights", "16GB", "--utilization", "1.0",
               "--seq-lens", "1024,8192", "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["bytes_per_token"] == 131072 and obj["bytes_per_block"] == 2097152
    assert obj["num_blocks"] == (80 * 10**9 - 16 * 10**9) // 2097152 == 30517
    assert obj["token_capacity"] == 30517 * 16
    assert obj["max_model_len"] == 8192
    assert [r["paged_max_seqs"] for r in obj["rows"]] == [30517 // 64, 30517 // 512]
    assert [r["contiguous_max_seqs"] for r in obj["rows"]] == [30517 * 16 // 8192] * 2


def test_cli_plan_preset_estimates_weights(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu-mem", "80GiB", "--seq-lens", "1k"]) == 0
    out = capsys.readouterr().out
    assert "estimated: 8.03B params" in out
    expected_blocks = (int(80 * GiB * 0.9) - PRESETS["llama-3-8b"].weight_bytes) // (2 * 2**20)
    assert f"blocks            {expected_blocks:,}" in out


def test_cli_plan_hf_config(tmp_path, capsys):
    cfg = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
           "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--hf-config", str(tmp_path), "--gpu-mem", "16GiB", "--dtype", "fp8",
                 "--block-size", "32", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["bytes_per_token"] == 2 * 16 * 64 * 1 * 24
    assert obj["spec"]["block_size"] == 32
    assert obj["weights_source"].startswith("estimated")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan"], "name a model"),
        (["plan", "--model", "llama-3-8b", "--layers", "4"], "use one of"),
        (["plan", "--layers", "4", "--kv-heads", "2"], "all of"),
        (["plan", "--model", "llama-3-70b", "--gpu-mem", "80GiB"], "no room for a KV block"),
        (["plan", "--model", "nope"], "unknown model preset"),
        (["plan", "--model", "llama-3-8b", "--block-size", "24"], "power of two"),
        (["plan", "--model", "llama-3-8b", "--utilization", "2"], "utilization"),
        (["plan", "--model", "llama-3-8b", "--seq-lens", "4096", "--max-model-len", "1024"], "exceeds"),
        (["plan", "--hf-config", "/nonexistent/config.json"], "no such file"),
    ],
)
def test_cli_plan_user_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_context_defaults_to_max_position_embeddings(capsys):
    # Llama-3-8B's config says 8192: that is the contiguous reservation, and the default lengths
    # stop there (they used to run to 32k, past the model's context).
    assert main(["plan", "--model", "llama-3-8b", "--json"]) == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out)
    assert obj["max_model_len"] == obj["model_max_len"] == 8192
    assert [r["seq_len"] for r in obj["rows"]] == [1024, 4096, 8192]
    assert obj["warnings"] == [] and captured.err == ""
    # A model with a longer context keeps all default lengths and adds its own.
    assert main(["plan", "--model", "llama-3.1-8b", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [r["seq_len"] for r in obj["rows"]] == [1024, 4096, 32768, 131072]


def test_shorter_seq_lens_keep_the_model_context():
    spec = PRESETS["llama-3-8b"].cache_spec()
    budget = MemoryBudget(total_bytes=80 * GiB, weights_bytes=PRESETS["llama-3-8b"].weight_bytes)
    plan = make_plan(spec, budget, [1024], model_max_len=8192)
    assert plan.max_model_len == 8192 and plan.warnings == ()
    assert plan.rows[0].contiguous_max_seqs == plan.token_capacity // 8192


@pytest.mark.parametrize("argv", [["--seq-lens", "1024,32k"], ["--max-model-len", "32768"]])
def test_planning_beyond_the_context_warns(argv, capsys):
    assert main(["plan", "--model", "llama-3-8b", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("pagedkv plan: warning: max_model_len 32,768 exceeds the model's "
                            "max_position_embeddings 8,192: positions past it were not trained "
                            "(unless rope scaling extends them)\n")
    assert "max model len     32,768" in captured.out


def test_mla_and_moe_plan_from_hf_config(tmp_path, capsys):
    from test_config import DEEPSEEK_V2_LITE

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    assert main(["plan", "--hf-config", str(tmp_path), "--gpu-mem", "80GiB", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["bytes_per_token"] == 31104 and obj["spec"]["mla"] is True
    assert obj["weights_bytes"] == 2 * 15_706_484_224
    assert obj["num_blocks"] == (int(80 * GiB * 0.9) - 2 * 15_706_484_224) // (31104 * 16)
    assert obj["max_model_len"] == 163840
    assert main(["plan", "--hf-config", str(tmp_path), "--seq-lens", "4k"]) == 0
    text = capsys.readouterr().out
    assert "MLA, one latent of 576 per token per layer" in text
    assert "= 1 latent × 576 × 2 × 27" in text
    assert "estimated: 15.71B params" in text


def test_unsizable_config_is_one_line(tmp_path, capsys):
    cfg = {"model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120,
           "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
           "vocab_size": 151936, "torch_dtype": "bfloat16",
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--hf-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot size this model's KV cache" in err and "'linear_attention'" in err
    assert err.count("\n") == 1
