#!/usr/bin/env bash
# Run vLLM 0.33.0's own KV-cache tests twice, with vLLM's BlockPool and with pagedkv's
# (pagedkv.vllm.pytest_plugin), and print pass/fail per file side by side, plus every test whose
# outcome differs.
#
# Needs the project venv (scripts/setup.sh). Into ./.vllm-test (ignored; PAGEDKV_VLLM_DIR to
# move it) it installs vllm==0.33.0 and the pinned pure-Python packages of requirements/
# vllm-test.txt with --no-deps (the venv's own packages stay untouched), and fetches the vLLM
# sdist for its tests/ tree. Offline model hubs: HF_HUB_OFFLINE=1.
# First it runs tests/test_kv_events_vllm_interop.py (pagedkv's KV events decoded by vLLM's
# classes; a failure there stops the script). vLLM's test_prefix_caching.py covers the drop-in
# pool's own events (test_kv_cache_events and the BlockStored/BlockRemoved tests).
# Takes about 20 minutes on a 2-core box (two passes of ~10); scripts/test.sh runs it last
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
    )
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$SITE:$ROOT/python"
OUT="$DIR/results"
rm -rf "$OUT"; mkdir -p "$OUT"
# pagedkv's KV-event batches against vLLM's own event classes and publisher (both directions);
# vLLM is importable here, so the test must not skip.
echo "test_vllm: KV-event wire interop (tests/test_kv_events_vllm_interop.py)"
PAGEDKV_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_kv_events_vllm_interop.py
cd "$SRC"
start=$(date +%s)
for i in "${!FILES[@]}"; do
    f=${FILES[$i]}
    for mode in stock pagedkv; do
        plugin=()
        [ "$mode" = pagedkv ] && plugin=(-p pagedkv.vllm.pytest_plugin)
        t0=$(date +%s)
        "$PY" -m pytest -q -p no:cacheprovider "${plugin[@]}" --junitxml="$OUT/$i.$mode.xml" \
            "$f" >"$OUT/$i.$mode.log" 2>&1 || true
        echo "test_vllm: $mode $f: $(tail -1 "$OUT/$i.$mode.log") [$(( $(date +%s) - t0 ))s]"
    done
done
echo "test_vllm: done in $(( $(date +%s) - start ))s"
"$PY" - "$OUT" "${FILES[@]}" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

out, files = sys.argv[1], sys.argv[2:]

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

print(f"\n{'file':<58} {'stock pass/fail/err':>20} {'pagedkv pass/fail/err':>22}")
tot = {"stock": [0, 0, 0], "pagedkv": [0, 0, 0]}
diffs = []
for i, f in enumerate(files):
    s, p = outcomes(f"{out}/{i}.stock.xml"), outcomes(f"{out}/{i}.pagedkv.xml")
    cs, cp = counts(s), counts(p)
    for m, c in (("stock", cs), ("pagedkv", cp)):
        tot[m] = [a + b for a, b in zip(tot[m], (c["passed"], c["failed"], c["error"]))]
    fmt = lambda c: f"{c['passed']}/{c['failed']}/{c['error']}"
    print(f"{f:<58} {fmt(cs):>20} {fmt(cp):>22}")
    for name in sorted(set(s) | set(p)):
        if s.get(name) != p.get(name):
            diffs.append(f"  {name}: stock {s.get(name)}, pagedkv {p.get(name)}")
fmt = lambda t: "/".join(map(str, t))
print(f"{'total':<58} {fmt(tot['stock']):>20} {fmt(tot['pagedkv']):>22}")
print(f"\ntests whose outcome differs: {len(diffs)}")
print("\n".join(diffs))
if diffs or tot["pagedkv"][0] == 0:
    print("test_vllm: FAILED (outcomes differ, or nothing passed)")
    sys.exit(1)
PYEOF
