#!/usr/bin/env bash
# Build the release wheel (manylinux_2_28, abi3, stripped), install it into a fresh virtualenv with
# its runtime dependencies only (numpy, tqdm: no torch), and smoke-test it from outside the source
# tree, so that what is tested is what users install: the block manager stepping into numpy step
# buffers, and `pagedkv --version`, `pagedkv plan`, `pagedkv simulate`, none of which needs torch.
#
# The build tools (requirements/wheel.txt: maturin, ziglang, auditwheel) live in their own venv,
# kept between runs in target/wheel-tools. zig links against glibc 2.28 whatever the build host's
# glibc is, which is what lets the wheel carry the manylinux_2_28 tag without a manylinux container.
# Environment: PYTHON (interpreter for both venvs, default python3), WHEEL_OUT (default target/wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TOOLS=$ROOT/target/wheel-tools
OUT=${WHEEL_OUT:-$ROOT/target/wheels}
die() { echo "wheel_smoke: $*" >&2; exit 1; }

stamp="$TOOLS/.requirements-$(sha256sum requirements/wheel.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "wheel_smoke: installing the build tools into $TOOLS"
    rm -rf "$TOOLS"
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --upgrade pip
    "$TOOLS/bin/python" -m pip install --quiet -r requirements/wheel.txt
    touch "$stamp"
fi

echo "wheel_smoke: building the manylinux_2_28 abi3 wheel"
rm -rf "$OUT"
log=$(mktemp)
# The tools venv first on PATH: maturin finds zig there (`python -m ziglang`).
if ! PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/maturin" build --release --strip --zig \
        --compatibility manylinux_2_28 --interpreter "$TOOLS/bin/python" --out "$OUT" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"
    die "the wheel did not build"
fi
rm -f "$log"
shopt -s nullglob
wheels=("$OUT"/pagedkv-*.whl)
[ ${#wheels[@]} -eq 1 ] || die "expected one wheel in $OUT, found ${#wheels[@]}"
wheel=${wheels[0]}
case "$(basename "$wheel")" in
    *-cp39-abi3-manylinux_2_28_x86_64.whl) ;;
    *) die "unexpected wheel tag: $(basename "$wheel") (want cp39-abi3-manylinux_2_28_x86_64)" ;;
esac
"$TOOLS/bin/auditwheel" show "$wheel" | tr '\n' ' ' | grep -q 'consistent with the following platform tag: "manylinux_2_28_x86_64"' \
    || die "auditwheel does not confirm manylinux_2_28: $("$TOOLS/bin/auditwheel" show "$wheel")"
echo "wheel_smoke: built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB)"

venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "$wheel"

# From a directory outside the checkout: `import pagedkv` must find the installed copy.
cd "$(dirname "$venv")"
"$venv/bin/python" - "$venv" <<'PY'
import importlib.util
import pathlib
import sys

venv = pathlib.Path(sys.argv[1]).resolve()

import numpy as np

import pagedkv
from pagedkv import _core

pkg = pathlib.Path(pagedkv.__file__).resolve().parent
assert venv in pkg.parents, f"imported {pkg}, not the installed wheel"
assert importlib.util.find_spec("torch") is None, "torch must not be installed for this test"
assert (pkg / "py.typed").is_file() and (pkg / "_core.pyi").is_file(), "typing files missing"

# The extension is stripped: no static symbol table, no debug sections.
def section_names(path):
    import struct
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not an ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
    strtab = header(shstrndx)
    names = []
    for i in range(shnum):
        name_off = header(i)[0]
        start = strtab[4] + name_off
        names.append(data[start:data.index(b"\0", start)].decode())
    return names

so = pathlib.Path(_core.__file__)
names = section_names(so)
leftover = [n for n in names if n == ".symtab" or n.startswith(".debug")]
assert not leftover, f"{so.name} is not stripped: {leftover}"

m = pagedkv.BlockManager(num_blocks=64, block_size=16, watermark_blocks=0)
bufs = pagedkv.StepBuffers(max_seqs=4, max_tokens=256, max_blocks_per_seq=m.max_blocks_per_seq)
assert bufs.backend == "numpy", bufs
m.attach_buffers(bufs)
r = m.admit(1, np.arange(100, dtype=np.int64))
assert (r.cached_tokens, r.num_blocks, r.num_tokens) == (0, 7, 100), r
m.fork(1, 2)
m.append_batch([1, 2], [7, 8])
# The shared tail block is copied on the first write only: one new block.
assert m.seq_len(2) == 101 and m.num_free_blocks == 64 - 7 - 1, m.num_free_blocks
info = m.step([1, 2], 1)
assert (info.num_seqs, info.num_tokens, info.num_copies, info.max_query_len) == (2, 2, 1, 1), info
v = bufs.to_device(info)
t1, t2 = m.block_table(1), m.block_table(2)
assert v.slot_mapping.tolist() == [t1[6] * 16 + 4, t2[6] * 16 + 4], (v.slot_mapping, t1, t2)
assert v.block_tables[0, :7].tolist() == t1 and v.block_tables[1, :7].tolist() == t2
assert v.seq_lens.tolist() == [101, 101] and v.query_start_loc.tolist() == [0, 1, 2]
try:
    m.free(99)
except pagedkv.UnknownSequenceError as err:
    assert err.seq_id == 99
else:
    raise AssertionError("free(99) did not raise")
m.free_batch([1, 2])
m.check_invariants()
assert m.num_free_blocks == 64
print(f"wheel_smoke: pagedkv {pagedkv.__version__} from {pkg}: BlockManager OK")
PY

# The console script, and the one-line answer where an optional dependency is missing.
out=$("$venv/bin/pagedkv" --version)
[[ "$out" == "pagedkv "* ]] || die "pagedkv --version printed: $out"
"$venv/bin/pagedkv" plan --model llama-3-8b --json >/dev/null || die "pagedkv plan failed"
sim=$("$venv/bin/pagedkv" simulate --requests 20 --quiet) || die "pagedkv simulate failed"
[[ "$sim" == *"paged finishes in"* ]] || die "pagedkv simulate printed: $sim"
# What needs torch says so in one line naming the extra, exit status 2.
set +e
err=$("$venv/bin/pagedkv" demo --quiet 2>&1 >/dev/null)
rc=$?
set -e
if ! { [ $rc -eq 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] \
        && [[ "$err" == *"pip install '.["*"in a clone"* ]]; }; then
    die "pagedkv demo without torch: status $rc, stderr: $err"
fi
echo "wheel_smoke: $out; plan, simulate OK without torch; demo: $err"
echo "wheel_smoke: passed"
