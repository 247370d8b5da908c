#!/usr/bin/env bash
# The core install's declared floors (pyproject: numpy>=1.26, tqdm>=4.66), tested: a fresh venv
# with exactly those versions and no torch runs the tests that need nothing else (the manager,
# scheduler, simulator, planner, errors, the CLI and the optional-dependency messages). The
# extras' floors are the versions requirements/dev.txt pins, which the main suite runs.
# Environment: PYTHON (default python3), FLOORS_VENV (default target/floors-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${FLOORS_VENV:-target/floors-venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet numpy==1.26.4 tqdm==4.66.0 pytest==9.2.0 \
    hypothesis==6.170.17 xxhash==4.1.0
# The extension the main venv built (scripts/setup.sh) is on the path with the sources.
PYTHONPATH="$PWD/python" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_manager_batch.py tests/test_manager_hypothesis.py tests/test_scheduler.py \
    tests/test_simulate.py tests/test_plan.py tests/test_config.py tests/test_errors.py \
    tests/test_keyed_pool.py tests/test_prefix_hash.py tests/test_optional_deps.py \
    tests/test_cli.py -k "not plot"
