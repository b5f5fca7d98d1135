#!/usr/bin/env bash
# CI: the ahead-of-time build. A wheel with the compiled kernel (zero_offload._C), built from a clone of the committed
# HEAD against the base interpreter's torch (`ZERO_OFFLOAD_BUILD_EXT=1 pip wheel --no-build-isolation`), installed
# into a venv over that interpreter and used from outside any tree, with no compiler and an empty kernel cache: only
# the prebuilt module can give the native path. Then the packaging metadata as installed.
# .ci/run starts it in the background beside the main suite (the suite leaves about a third of the 2 cores idle, and
# the compile fills it); the clone is its own, so its build/ and egg-info never touch the tree the suite imports.
# PYTHON: the base interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/zero_offload_aot.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
git clone -q "$PWD" "$WORK/src"
(cd "$WORK/src" && ZERO_OFFLOAD_BUILD_EXT=1 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" .)
"$PY" -m venv --system-site-packages "$WORK/aot"
"$WORK/aot/bin/pip" install -q --no-deps "$WORK"/dist/zero_offload-*.whl
# No compiler and an empty cache: only the prebuilt module can give the native path.
cd "$WORK"
CXX=/nonexistent ZERO_OFFLOAD_CACHE_DIR="$WORK/no-jit" "$WORK/aot/bin/python" - "$WORK/aot" <<'EOF'
import sys, warnings
warnings.simplefilter("error")
import torch, zero_offload
from zero_offload import _build, functional
assert zero_offload.__file__.startswith(sys.argv[1]), zero_offload.__file__
p = torch.nn.Parameter(torch.randn(4097))
ref = torch.nn.Parameter(p.detach().clone())
ours, adamw = zero_offload.OffloadOptimizer([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, foreach=False)
p.grad = torch.randn(4097)
ref.grad = p.grad.clone()
ours.step()
adamw.step()
torch.testing.assert_close(p.detach(), ref.detach())
assert _build.status().state == "prebuilt", _build.status()
assert functional.resolve_path() != "torch"
print(f"AOT wheel OK: {zero_offload.__file__}, kernel {_build.status().state}, path {functional.resolve_path()}")
# The packaging metadata as installed: license, the Python floor the floor job runs, typed, no pybind11 at run time.
import importlib.metadata, os
meta = importlib.metadata.metadata("zero_offload")
assert meta["License-Expression"] == "MIT" and meta["Requires-Python"] == ">=3.9", dict(meta)
assert not any(r.startswith("pybind11") for r in meta.get_all("Requires-Dist")), meta.get_all("Requires-Dist")
assert os.path.isfile(os.path.join(os.path.dirname(zero_offload.__file__), "py.typed"))
assert any(str(f).endswith("LICENSE") for f in importlib.metadata.files("zero_offload"))
print("metadata OK:", meta["License-Expression"], "Requires-Python", meta["Requires-Python"])
EOF
