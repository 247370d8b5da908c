#!/usr/bin/env bash
# Run vLLM 0.33.0's own KV-cache and scheduler tests three times: stock, with pagedkv's BlockPool
# under vLLM's manager ("pool"), and with pagedkv's whole KVCacheManager ("manager", which also
# uses the pool) -- both through pagedkv.vllm.pytest_plugin -- and print pass/fail/error per file
# side by side, plus every test whose outcome differs from stock.
# PAGEDKV_VLLM_MODES picks the passes (default "stock pool manager").
#
# Needs the project venv (scripts/setup.sh). Into ./.vllm-test (ignored; PAGEDKV_VLLM_DIR to
# move it) it installs vllm==0.33.0 and the pinned pure-Python packages of requirements/
# vllm-test.txt with --no-deps (the venv's own packages stay untouched), and fetches the vLLM
# sdist for its tests/ tree. Offline model hubs: HF_HUB_OFFLINE=1; the scheduler tests' model
# config (facebook/opt-125m's config.json: no weights, no tokenizer) is written into an offline
# hub cache under $DIR/hf, and VLLM_TARGET_DEVICE=cpu gives vLLM its CPU platform.
# First it runs tests/test_kv_events_vllm_interop.py (pagedkv's KV events decoded by vLLM's
# classes; a failure there stops the script). vLLM's test_prefix_caching.py covers the drop-in
# pool's own events (test_kv_cache_events and the BlockStored/BlockRemoved tests).
# Takes about 60 minutes on a 2-core box (three passes of ~20); scripts/test.sh runs it last
# (PAGEDKV_SKIP_VLLM=1 skips it). Exits 1 when a test's outcome differs between the two pools or
# when no test passed.
# Usage: scripts/test_vllm.sh [test paths relative to vLLM's source tree ...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PAGEDKV_VENV:-.venv}
case $VENV in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "test_vllm: $PY missing; run scripts/setup.sh first" >&2; exit 1; }
DIR=${PAGEDKV_VLLM_DIR:-$ROOT/.vllm-test}
SITE="$DIR/site"
mkdir -p "$DIR"

stamp="$SITE/.pins-$(sha256sum requirements/vllm-test.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "test_vllm: installing vllm==0.33.0 + import-chain packages into $SITE (--no-deps)"
    rm -rf "$SITE"
    "$PY" -m pip install --quiet --no-deps --target "$SITE" -r requirements/vllm-test.txt
    touch "$stamp"
fi
SRC="$DIR/vllm-0.33.0"
if [ ! -d "$SRC/tests/v1/core" ]; then
    echo "test_vllm: fetching the vLLM 0.33.0 sdist (for its tests)"
    archive=$("$PY" scripts/fetch_sdist.py vllm 0.33.0 "$DIR")
    tar xzf "$archive" -C "$DIR" vllm-0.33.0/tests
fi

if [ $# -gt 0 ]; then
    FILES=("$@")
else
    FILES=(
        tests/v1/core/test_prefix_caching.py
        tests/v1/core/test_kv_cache_utils.py
        tests/v1/core/test_single_type_kv_cache_manager.py
        tests/v1/core/prefix_cache
        tests/v1/core/test_kv_cache_metrics.py
        tests/v1/core/test_kv_sharing.py
        tests/v1/core/test_swa_inflight_window_free.py
        tests/v1/core/test_deferred_block_free.py
        tests/v1/core/test_prefix_replay.py
        tests/v1/core/test_reset_prefix_cache_e2e.py
        tests/v1/core/test_scheduler.py
    )
fi
read -r -a MODES <<<"${PAGEDKV_VLLM_MODES:-stock pool manager}"

# An offline hub cache holding facebook/opt-125m's config.json (what vLLM's test helper reads).
HFD="$DIR/hf/hub/models--facebook--opt-125m"
REV=0000000000000000000000000000000000000000
if [ ! -f "$HFD/snapshots/$REV/config.json" ]; then
    mkdir -p "$HFD/refs" "$HFD/snapshots/$REV"
    printf %s "$REV" >"$HFD/refs/main"
    cat >"$HFD/snapshots/$REV/config.json" <<'JSON'
{"_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
 "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
 "do_layer_norm_before": true, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
 "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
 "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
 "prefix": "</s>", "torch_dtype": "float16", "use_cache": true, "vocab_size": 50272,
 "word_embed_proj_dim": 768}
JSON
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$SITE:$ROOT/python"
export HF_HOME="$DIR/hf" VLLM_TARGET_DEVICE=cpu
OUT=${PAGEDKV_VLLM_OUT:-$DIR/results}
rm -rf "$OUT"; mkdir -p "$OUT"
# pagedkv's KV-event batches against vLLM's own event classes and publisher (both directions);
# vLLM is importable here, so the test must not skip.
echo "test_vllm: KV-event wire interop (tests/test_kv_events_vllm_interop.py)"
PAGEDKV_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_kv_events_vllm_interop.py
# pagedkv's manager against vLLM's, call for call, on seeded traces.
echo "test_vllm: drop-in manager vs vLLM's (tests/test_vllm_manager.py)"
PAGEDKV_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm_manager.py
cd "$SRC"
start=$(date +%s)
for i in "${!FILES[@]}"; do
    f=${FILES[$i]}
    for mode in "${MODES[@]}"; do
        plugin=()
        [ "$mode" != stock ] && plugin=(-p pagedkv.vllm.pytest_plugin)
        want_manager=0
        [ "$mode" = manager ] && want_manager=1
        t0=$(date +%s)
        PAGEDKV_VLLM_TEST_MANAGER=$want_manager "$PY" -m pytest -q -p no:cacheprovider \
            "${plugin[@]}" --junitxml="$OUT/$i.$mode.xml" \
            "$f" >"$OUT/$i.$mode.log" 2>&1 || true
        echo "test_vllm: $mode $f: $(tail -1 "$OUT/$i.$mode.log") [$(( $(date +%s) - t0 ))s]"
    done
done
echo "test_vllm: done in $(( $(date +%s) - start ))s"
"$PY" - "$OUT" "${MODES[*]}" "${FILES[@]}" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

out, modes, files = sys.argv[1], sys.argv[2].split(), sys.argv[3:]

def outcomes(path):
    res = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return res
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        kind = "passed"
        for child in tc:
            if child.tag in ("failure", "error"):
                kind = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                kind = "skipped"
        res[name] = kind
    return res

def counts(r):
    c = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for v in r.values():
        c[v] += 1
    return c

fmt = lambda c: f"{c[0]}/{c[1]}/{c[2]}"
print(f"\n{'file':<50}" + "".join(f"{m + ' pass/fail/err':>24}" for m in modes))
tot = {m: [0, 0, 0] for m in modes}
diffs = []
for i, f in enumerate(files):
    res = {m: outcomes(f"{out}/{i}.{m}.xml") for m in modes}
    row = f"{f:<50}"
    for m in modes:
        c = counts(res[m])
        c3 = (c["passed"], c["failed"], c["error"])
        tot[m] = [a + b for a, b in zip(tot[m], c3)]
        row += f"{fmt(c3):>24}"
    print(row)
    base = modes[0]
    for m in modes[1:]:
        for name in sorted(set(res[base]) | set(res[m])):
            if res[base].get(name) != res[m].get(name):
                diffs.append(f"  [{m}] {name}: {base} {res[base].get(name)}, {m} {res[m].get(name)}")
print(f"{'total':<50}" + "".join(f"{fmt(tot[m]):>24}" for m in modes))
print(f"\ntests whose outcome differs from {modes[0]}: {len(diffs)}")
print("\n".join(diffs))
if diffs or any(tot[m][0] == 0 for m in modes):
    print("test_vllm: FAILED (outcomes differ, or nothing passed)")
    sys.exit(1)
PYEOF
