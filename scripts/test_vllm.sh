#!/usr/bin/env bash
# Run vLLM 0.33.0's own KV-cache and scheduler tests three times: stock, with pagedkv's BlockPool
# under vLLM's manager ("pool"), and with pagedkv's whole KVCacheManager ("manager", which also
# uses the pool) -- both through pagedkv.vllm.pytest_plugin -- and print pass/fail/error per file
# side by side, plus every test whose outcome differs from stock.
# PAGEDKV_VLLM_MODES picks the passes (default "stock pool manager").
# Then the offloading spec: vLLM's own offloading manager tests
# (tests/v1/kv_offload/cpu/test_manager.py) twice, "stock" and "offload" (pagedkv's
# PagedKVOffloadingManager built wherever vLLM's CPUOffloadingManager is built with the LRU
# policy, PAGEDKV_VLLM_TEST_OFFLOAD=1); the tests whose outcome differs are checked against the
# list of known differences (scripts/vllm_offload_known.tsv), each with its reason.
# PAGEDKV_VLLM_SKIP_MAIN=1 runs only this offloading part.
#
# Needs the project venv (scripts/setup.sh). Into ./.vllm-test (ignored; PAGEDKV_VLLM_DIR to
# move it) it installs vllm==0.33.0 and the pinned pure-Python packages of requirements/
# vllm-test.txt with --no-deps (the venv's own packages stay untouched), and fetches the vLLM
# sdist for its tests/ tree (both skipped when already there). Offline model hubs:
# HF_HUB_OFFLINE=1; the scheduler tests' model config (facebook/opt-125m's config.json: no
# weights, no tokenizer) is written into an offline hub cache under $DIR/hf, and
# VLLM_TARGET_DEVICE=cpu gives vLLM its CPU platform.
# First it runs pagedkv's own tests with vLLM importable, in one pytest process (a failure there
# stops the script): tests/test_kv_events_vllm_interop.py (pagedkv's KV events decoded by vLLM's
# classes), tests/test_vllm_manager.py and the offloading spec's tests/test_vllm_offload*.py
# (test_vllm_offload_tiers.py: the disk and Redis tiers under vLLM's TieringOffloadingSpec; vLLM's
# own tiering tests drive its example and fs tiers' internals, so they get no pagedkv pass).
# vLLM's test_prefix_caching.py covers the drop-in pool's own events (test_kv_cache_events and
# the BlockStored/BlockRemoved tests).
# Each pass is one pytest process over all of its files (vLLM's ~15 s import paid once a pass),
# and the passes run two at a time (PAGEDKV_VLLM_JOBS, default 2: one a core; each has its own
# log, junit file, temp dirs and vLLM cache); the summary splits each pass's junit file back per
# file. Takes about 17 minutes on a 2-core box (a main pass ~10 minutes, ~7 alone: stock beside
# pool, then manager beside the two offloading passes); scripts/test.sh runs it last
# (PAGEDKV_SKIP_VLLM=1 skips it). Exits 1 when a test's outcome differs from stock's (and, for the
# offloading passes, is not a known difference) or when a pass passed nothing.
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
# pagedkv's own tests with vLLM importable (vLLM is importable here, so none may skip for want of
# it), in one pytest process; a failure there stops the script: its KV-event batches against
# vLLM's own event classes and publisher (both directions), its manager against vLLM's, call for
# call, on seeded traces, and its offloading spec (its manager, worker and version gate).
echo "test_vllm: KV-event wire interop, drop-in manager vs vLLM's, offloading spec and tiers" \
    "(tests/test_kv_events_vllm_interop.py tests/test_vllm_manager.py tests/test_vllm_offload*.py)"
PAGEDKV_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_kv_events_vllm_interop.py \
    tests/test_vllm_manager.py tests/test_vllm_offload.py tests/test_vllm_offload_copy.py \
    tests/test_vllm_offload_keyed.py tests/test_vllm_offload_tiers.py
# The per-file table and the differences from the first pass (run once per group of passes).
SUMMARY="$OUT/summary.py"
cat >"$SUMMARY" <<'PYEOF'
import os
import sys
import xml.etree.ElementTree as ET

out, modes, files = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
prefix = os.environ.get("SUMMARY_PREFIX", "")
# Known differences, one a line: "test id<TAB>reason" (the ids the diff lines print).
expected = {}
if os.environ.get("SUMMARY_EXPECTED"):
    with open(os.environ["SUMMARY_EXPECTED"]) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, _, why = line.rstrip("\n").partition("\t")
                expected[name] = why

def outcomes(path):
    res = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return res
    for tc in root.iter("testcase"):
        # The classname carries the source tree's path from pytest's rootdir (".vllm-test.
        # vllm-0.33.0.tests.v1..." under the repository, "tests.v1..." elsewhere): keep the part
        # from vLLM's tests package on, so ids match the known list wherever the tree sits.
        cls = tc.get("classname") or ""
        cut = cls.find("tests.v1.")
        name = f"{cls[cut:] if cut > 0 else cls}::{tc.get('name')}"
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
known = []
# One junit file per pass, over all the files: each test goes back to the file (or directory)
# argument its module lies in (the longest match, as dotted paths from vLLM's tests package on).
dotted = [os.path.normpath(f.split("::")[0]).removesuffix(".py").replace("/", ".") for f in files]

def owner(name):
    mod = name.split("::")[0]
    best = None
    for i, d in enumerate(dotted):
        if (mod == d or mod.startswith(d + ".")) and (best is None or len(d) > len(dotted[best])):
            best = i
    return best

per_file = {m: [{} for _ in files] for m in modes}
for m in modes:
    for name, kind in outcomes(f"{out}/{prefix}{m}.xml").items():
        i = owner(name)
        if i is None:
            sys.exit(f"test_vllm: {name} matches none of the paths {files}")
        per_file[m][i][name] = kind
for i, f in enumerate(files):
    res = {m: per_file[m][i] for m in modes}
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
                line = f"  [{m}] {name}: {base} {res[base].get(name)}, {m} {res[m].get(name)}"
                if name in expected:
                    known.append(f"{line}\n      known: {expected.pop(name)}")
                else:
                    diffs.append(line)
print(f"{'total':<50}" + "".join(f"{fmt(tot[m]):>24}" for m in modes))
if known:
    print(f"\nknown differences from {modes[0]} (each with its reason): {len(known)}")
    print("\n".join(known))
if expected:
    print(f"\nknown differences that did not occur (now the same outcome): {len(expected)}")
    print("\n".join(f"  {n}" for n in sorted(expected)))
print(f"\ntests whose outcome differs from {modes[0]}" + (" (not known)" if known else "")
      + f": {len(diffs)}")
print("\n".join(diffs))
if diffs or any(tot[m][0] == 0 for m in modes):
    print("test_vllm: FAILED (outcomes differ, or nothing passed)")
    sys.exit(1)
PYEOF
# One pytest process per pass over all of its files (vLLM's import, ~15 s, paid once a pass, not
# once a file), at most PAGEDKV_VLLM_JOBS (default 2, one a core) passes at a time. Each pass has
# its own log, junit file, TMPDIR (vLLM's conftest writes dummy model dirs under the temp dir),
# pytest basetemp and VLLM_CACHE_ROOT; the hub cache under $DIR/hf is only read.
# run_pass NAME MODE PATHS...: MODE is stock, pool, manager or offload.
run_pass() {
    local name=$1 mode=$2 plugin=() manager=0 offload=0 t0
    shift 2
    [ "$mode" != stock ] && plugin=(-p pagedkv.vllm.pytest_plugin)
    [ "$mode" = manager ] && manager=1
    [ "$mode" = offload ] && offload=1
    t0=$(date +%s)
    rm -rf "$OUT/tmp.$name"
    mkdir -p "$OUT/tmp.$name/tmp" "$OUT/tmp.$name/cache"
    PAGEDKV_VLLM_TEST_MANAGER=$manager PAGEDKV_VLLM_TEST_OFFLOAD=$offload \
        TMPDIR="$OUT/tmp.$name/tmp" VLLM_CACHE_ROOT="$OUT/tmp.$name/cache" \
        "$PY" -m pytest -q -p no:cacheprovider "${plugin[@]}" \
        --basetemp="$OUT/tmp.$name/pytest" --junitxml="$OUT/$name.xml" \
        "$@" >"$OUT/$name.log" 2>&1 || true
    echo "test_vllm: $mode pass ($# paths): $(tail -1 "$OUT/$name.log") [$(( $(date +%s) - t0 ))s]"
}

# vLLM's offloading manager tests with pagedkv's manager in place of the CPU one ("offload").
# Every known difference, with its reason; a difference not listed fails the run.
OFFLOAD_FILES=(tests/v1/kv_offload/cpu/test_manager.py)
EXPECTED="$OUT/offload-expected.txt"
cat "$ROOT/scripts/vllm_offload_known.tsv" >"$EXPECTED"

cd "$SRC"
[ "${PAGEDKV_VLLM_SKIP_MAIN:-0}" = 1 ] && FILES=()
# The queue, longest passes first: "name mode" (the main passes, then the offloading ones).
QUEUE=()
if [ ${#FILES[@]} -gt 0 ]; then
    for mode in "${MODES[@]}"; do QUEUE+=("$mode $mode"); done
fi
QUEUE+=("offload.stock stock" "offload.offload offload")
JOBS=${PAGEDKV_VLLM_JOBS:-2}
start=$(date +%s)
running=0
for job in "${QUEUE[@]}"; do
    read -r name mode <<<"$job"
    if [ "$running" -ge "$JOBS" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    if [ "${name%%.*}" = offload ]; then
        run_pass "$name" "$mode" "${OFFLOAD_FILES[@]}" &
    else
        run_pass "$name" "$mode" "${FILES[@]}" &
    fi
    running=$((running + 1))
done
wait
echo "test_vllm: all passes done in $(( $(date +%s) - start ))s"

status=0
if [ ${#FILES[@]} -gt 0 ]; then
    "$PY" "$SUMMARY" "$OUT" "${MODES[*]}" "${FILES[@]}" || status=1
fi
SUMMARY_PREFIX=offload. SUMMARY_EXPECTED="$EXPECTED" "$PY" "$SUMMARY" "$OUT" "stock offload" \
    "${OFFLOAD_FILES[@]}" || status=1
exit $status
