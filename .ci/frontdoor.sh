#!/usr/bin/env bash
# CI: the front door as a new user meets it. A fresh clone, a fresh venv, an empty kernel cache with stale locks
# planted in it (what a build killed by a signal leaves behind), then the README Quickstart's first command:
#     pip install torch==2.13.0 -e ".[demo]" && python -m zero_offload.demo
# (the Quickstart's second command, the test suite, runs once in .ci/run already), and a kernel smoke check
# against torch.optim.AdamW. Then a second fresh venv sharing the first one's cache must load the first one's
# build: the kernel is compiled exactly once, and `report` must say whose build each venv got.
#
# Venv a is made as a user makes one (plain `python3 -m venv`: torch and its dependencies installed into it). Venv
# b is --system-site-packages over the CPU torch .ci/run installed into the base interpreter, so its torch sits at
# another path than a's: the cache key holds torch's version, git revision and ABI, no paths, so b loads a's build.
# The clone is of the committed HEAD. The demo runs as the Quickstart has it (300 steps per optimizer: 49 s on an
# unloaded 2-core x86 machine, plus the one compile); FRONTDOOR_DEMO_ARGS adds arguments for a loaded machine
# (e.g. "--steps 20 --batch 4", both documented in `python -m zero_offload.demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/zero_offload_frontdoor.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
read -r -a DEMO_ARGS <<<"${FRONTDOOR_DEMO_ARGS:-}"
unset ZERO_OFFLOAD_CACHE_DIR ZERO_OFFLOAD_SIMD ZERO_OFFLOAD_BUILD_WAIT
# An empty cache of this run's own (and TORCH_EXTENSIONS_DIR honoured: the cache is $TORCH_EXTENSIONS_DIR/zero_offload).
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
CACHE="$TORCH_EXTENSIONS_DIR/zero_offload"
fail() { echo "frontdoor: FAILED: $*" >&2; exit 1; }

git clone -q "$ROOT" "$WORK/clone"
cd "$WORK/clone"

cat >"$WORK/smoke.py" <<'EOF'
# The native kernel against torch.optim.AdamW (a SIMD tail size), and which build this venv got.
import sys
import torch
import zero_offload
from zero_offload import _build, functional

clone, expect = sys.argv[1], sys.argv[2]
assert zero_offload.__file__.startswith(clone), f"zero_offload imported from {zero_offload.__file__}"
p = torch.nn.Parameter(torch.randn(4097))
ref = torch.nn.Parameter(p.detach().clone())
ours, adamw = zero_offload.OffloadOptimizer([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, foreach=False)
for _ in range(3):
    p.grad = torch.randn(4097)
    ref.grad = p.grad.clone()
    ours.step()
    adamw.step()
    torch.testing.assert_close(p.detach(), ref.detach())
st = _build.status()
assert st.state == expect, st
assert functional.resolve_path() not in ("torch", "torch-fused"), functional.resolve_path()
print(f"smoke OK in {sys.prefix} (torch {torch.__file__}): kernel {st.summary()}, path {functional.resolve_path()}")
EOF

new_venv() {  # new_venv NAME [VENV_OPTION...]
    python3 -m venv "${@:2}" "$WORK/$1"
    "$WORK/$1/bin/pip" install -q torch==2.13.0 -e ".[demo]"
}

echo "== venv a (plain, as a user makes it): Quickstart, with stale locks planted in an empty cache"
new_venv a
KEYDIR=$("$WORK/a/bin/python" -c "from zero_offload import _build; print(_build.cache_dir())")
[[ $KEYDIR == "$CACHE"/* ]] || fail "cache folder $KEYDIR is not under TORCH_EXTENSIONS_DIR"
mkdir -p "$KEYDIR"
# Our lock file, naming a holder that no longer runs, and torch's FileBaton `lock` in the build's own folder.
echo "999999 deadhost $(($(date +%s) - 7200))" >"$KEYDIR.lock"
touch "$KEYDIR/lock"
touch -d '2 hours ago' "$KEYDIR.lock" "$KEYDIR/lock"
# Bounded: a hang here is the failure this script exists to catch.
status=0
timeout 1800 "$WORK/a/bin/python" -m zero_offload.demo ${DEMO_ARGS[@]+"${DEMO_ARGS[@]}"} 2>"$WORK/a.err" || status=$?
cat "$WORK/a.err" >&2
[[ $status == 0 ]] || fail "the demo in venv a (exit status $status)"
[[ $(grep -c "compiling the CPU-Adam kernel" "$WORK/a.err") == 1 ]] || fail "venv a: no single compile message"
grep -q "native kernel jit-built now in" "$WORK/a.err" || fail "venv a: the demo does not say it built the kernel"
"$WORK/a/bin/python" "$WORK/smoke.py" "$WORK/clone" jit-cached

echo "== venv b (over the base interpreter's torch): same clone and cache, no rebuild"
new_venv b --system-site-packages
torch_of() { "$WORK/$1/bin/python" -c 'import torch; print(torch.__file__)'; }
[[ $(torch_of a) == "$WORK/a/"* && $(torch_of b) != "$WORK/"* ]] ||
    fail "venv a's torch ($(torch_of a)) should be its own, venv b's ($(torch_of b)) the base interpreter's"
"$WORK/b/bin/python" "$WORK/smoke.py" "$WORK/clone" jit-cached 2>"$WORK/b.err" || { cat "$WORK/b.err"; fail "venv b"; }
! grep -q "compiling" "$WORK/b.err" || { cat "$WORK/b.err"; fail "venv b compiled the kernel again"; }
"$WORK/b/bin/python" -m zero_offload.report | tee "$WORK/b.report"
grep -q "^native kernel    jit-cached (built .* by $WORK/a/bin/python)" "$WORK/b.report" ||
    fail "venv b's report does not name venv a's build"
BUILDS=$(find "$CACHE" -name manifest.json | wc -l)
[[ $BUILDS == 1 ]] || fail "$BUILDS builds in the cache, expected 1"
[[ -z $(find "$CACHE" -maxdepth 1 -name '.build-*') ]] || fail "temporary build folders left in $CACHE"
echo "frontdoor OK: built once in venv a, loaded by venv b; stale locks did not block"
