#!/usr/bin/env bash
# GPU truth in one call: every @pytest.mark.cuda test, then the GPU
# benchmarks G1..G4, on a machine with an NVIDIA GPU, torch, cupy and no
# network.  From the repository root:
#
#   bash tests/gpu/wheels.sh      # once, where there is network: fills .whl/ (git-ignored)
#   bash tests/gpu/run.sh         # on the GPU machine, with .whl/ carried along
#
# It installs the wheels in .whl/ (the broker's pure-Python dependencies;
# torch, cupy, numpy, pytest and ml_dtypes come with the GPU machine) into a
# private directory, lays tensordepot out there from this tree, and writes
# to $OUT (else ./gpu-results):
#
#   summary.json    each step's exit status and what it found, rewritten after
#                   every step (a timeout keeps what ran)
#   env.json        GPU, driver, versions, date
#   pytest.log      the CUDA tests' output; junit.xml, the same as JUnit XML
#   gpu-bench.json  G1..G4 rows (ratios against their peers, pass/miss) and samples
#   bench.log       the benchmark's output
#
# Steps: a GPU check (nvidia-smi, then cupy, then torch: nothing is imported
# before the check that needs it), the wheels, the CUDA tests, G1..G4.  It
# stops at the first step that cannot go on.  The device tool allows 10
# minutes a command and 15 in all, start included: this takes under 5
# (tests 170 s, benchmarks 90 s), so a rerun fits.
#
# Exit status: 0 when every CUDA test passed, none was skipped, and every
# benchmark ran; the benchmark's goals are reported, not enforced.  4: no
# usable GPU here (it says why); 3: no wheels; otherwise the failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
out=${OUT:-$root/gpu-results}
wheels=${TENSORDEPOT_WHEELS:-$root/.whl}
mkdir -p "$out"
rm -f "$out/summary.json" "$out/steps.json"
py=${PYTHON:-python3}

# Record a step's exit status and rewrite summary.json from what is in $out.
step() {
  "$py" "$root/tests/gpu/summary.py" "$out" "$1" "$2" "${3:-}"
}

# 1. A GPU, seen by the driver, by cupy and by torch, in that order.
why=""
if ! smi=$(nvidia-smi -L 2>&1) || [ -z "$smi" ]; then
  why="nvidia-smi finds no GPU: ${smi:-no output}"
elif ! why=$("$py" - <<'PY' 2>&1
import sys
try:
    import cupy
except ImportError as exc:
    sys.exit(f"cupy is not installed ({exc})")
try:
    n = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:  # noqa: BLE001 - cupy reports driver trouble as various errors
    sys.exit(f"cupy cannot reach a GPU: {exc}")
if not n:
    sys.exit("cupy sees no GPU")
try:
    import torch
except ImportError as exc:
    sys.exit(f"torch is not installed ({exc})")
if not torch.cuda.is_available():
    sys.exit("torch sees no GPU (torch.cuda.is_available() is False)")
PY
); then
  why=${why:-the GPU check failed}
else
  why=""
fi
if [ -n "$why" ]; then
  echo "no usable GPU here: $why" >&2
  step gpu 4 "$why"
  exit 4
fi
step gpu 0

# 2. The broker's pure-Python dependencies, from wheels carried along.
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  why="no wheels in $wheels: run 'bash tests/gpu/wheels.sh' where there is network, and carry .whl"
  echo "$why" >&2
  step wheels 3 "$why"
  exit 3
fi
site=$(mktemp -d /tmp/tensordepot-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || ! "$py" tests/gpu/assemble.py "$site"; then
  step wheels 3 "installing the wheels failed"
  exit 3
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TENSORDEPOT_REQUIRE_CUDA=1
unset CUDA_VISIBLE_DEVICES  # the tests set it per process themselves
"$py" - "$out/env.json" <<'PY'
import datetime, json, platform, subprocess, sys
info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version()}
for mod in ("torch", "cupy", "numpy", "pydantic", "fastapi", "uvicorn", "jax", "ml_dtypes"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception as exc:  # noqa: BLE001
        info[mod] = f"unavailable: {exc}"
import torch
info["gpu"] = torch.cuda.get_device_name(0)
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True, check=False)
info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
open(sys.argv[1], "w").write(json.dumps(info, indent=2))
print(json.dumps(info))
PY
step wheels 0

# 3. Every file with CUDA tests (collecting the whole suite would need the
# CPU suite's extras).  TENSORDEPOT_REQUIRE_CUDA=1: a CUDA test that skips
# fails (tests/conftest.py).  Warnings stay errors for ResourceWarning (a
# leak) and unraisable exceptions; third-party deprecations are shown.
mapfile -t files < <(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
echo "CUDA test files: ${files[*]}"
per_test=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=120); fi
timeout 170 "$py" -m pytest -m cuda "${files[@]}" "${per_test[@]}" -p no:cacheprovider -rA --durations=15 \
  -W default::DeprecationWarning -W default::FutureWarning -W default::UserWarning \
  --junitxml="$out/junit.xml" 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}
step tests "$tests_rc"
tests_rc=$?  # also non-zero when a test was skipped

# 4. G1..G4.
timeout 90 "$py" tests/gpu/bench.py --out "$out/gpu-bench.json" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
step bench "$bench_rc"

cat "$out/summary.json"
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
