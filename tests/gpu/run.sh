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
#   env.json        GPU, driver, versions, date
#   pytest.log      the CUDA tests' output; junit.xml, the same as JUnit XML
#   gpu-bench.json  G1..G4 rows (ratios against their peers, pass/miss) and samples
#   bench.log       the benchmark's output
#   summary.json    test counts, the G rows, and the exit status of each step
#
# Exit status: 0 when every CUDA test passed (none skipped) and every
# benchmark ran; the benchmark's goals are reported, not enforced.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
out=${OUT:-$root/gpu-results}
wheels=${TENSORDEPOT_WHEELS:-$root/.whl}
mkdir -p "$out"
py=${PYTHON:-python3}

if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "no wheels in $wheels: run 'bash tests/gpu/wheels.sh' where there is network, and carry .whl" >&2
  exit 3
fi
site=$(mktemp -d /tmp/tensordepot-site.XXXXXX)
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "$wheels"/*.whl || { echo "installing the wheels failed" >&2; exit 3; }
"$py" tests/gpu/assemble.py "$site" || exit 3
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
try:
    import torch
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception as exc:  # noqa: BLE001
    info["gpu"] = f"unavailable: {exc}"
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, check=False)
    info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
except OSError as exc:
    info["nvidia_smi"] = f"unavailable: {exc}"
open(sys.argv[1], "w").write(json.dumps(info, indent=2))
print(json.dumps(info))
PY

# Every file with CUDA tests (collecting the whole suite would need the CPU
# suite's extras).  Warnings stay errors for ResourceWarning (a leak) and
# unraisable exceptions; third-party deprecations are shown, not fatal.
mapfile -t files < <(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
echo "CUDA test files: ${files[*]}"
per_test=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=150); fi
# The device tool allows 10 minutes a command: 330 s of tests, 200 s of benchmarks.
timeout 330 "$py" -m pytest -m cuda "${files[@]}" "${per_test[@]}" -p no:cacheprovider -rA --durations=15 \
  -W default::DeprecationWarning -W default::FutureWarning -W default::UserWarning \
  --junitxml="$out/junit.xml" 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}

timeout 200 "$py" tests/gpu/bench.py --out "$out/gpu-bench.json" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

"$py" - "$out" "$tests_rc" "$bench_rc" <<'PY'
import json, pathlib, sys, xml.etree.ElementTree as ET
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_exit": tests_rc, "bench_exit": bench_rc, "tests": None, "bench": None}
try:
    suites = ET.parse(out / "junit.xml").getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["tests"]["failed"] = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
                                  if c.find("failure") is not None or c.find("error") is not None]
except Exception as exc:  # noqa: BLE001
    summary["tests"] = f"no junit.xml: {exc}"
try:
    bench = json.loads((out / "gpu-bench.json").read_text())
    summary["bench"] = {"rows": [{k: r[k] for k in ("id", "measured", "unit", "goal", "pass")} for r in bench["rows"]],
                        "errors": bench["errors"], "machine": bench["machine"]}
except Exception as exc:  # noqa: BLE001
    summary["bench"] = f"no gpu-bench.json: {exc}"
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY

rm -rf "$site"
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
