#!/usr/bin/env bash
# Drive `pagedkv serve` with GuideLLM, a third-party load generator (tests/test_guidellm.py).
#
# Needs the project venv (scripts/setup.sh). Installs the pins of requirements/guidellm.txt with
# --no-deps into ./.guidellm/site (ignored; PAGEDKV_GUIDELLM_SITE moves it), beside the venv,
# whose own torch, transformers and click stay untouched; reinstalls only when the pins change.
# Bounded: 6 requests on the tiny model, a 300 s limit on GuideLLM's run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PAGEDKV_VENV:-.venv}
case $VENV in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "test_guidellm: $PY missing; run scripts/setup.sh first" >&2; exit 1; }
SITE=${PAGEDKV_GUIDELLM_SITE:-$ROOT/.guidellm/site}
stamp="$SITE/.pins-$(sha256sum requirements/guidellm.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "test_guidellm: installing guidellm and its pins into $SITE (--no-deps)"
    rm -rf "$SITE"
    "$PY" -m pip install --quiet --no-deps --target "$SITE" -r requirements/guidellm.txt
    touch "$stamp"
fi
PAGEDKV_GUIDELLM_SITE="$SITE" PYTHONPATH="$ROOT/python" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_guidellm.py "$@"
