"""Arrow Flight is an extra: without pyarrow, everything local works, and the
Flight options say what to install."""

from __future__ import annotations

import subprocess
import sys

from _harness import TEST_PREFIX

BLOCK = "import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.flight'] = None; "


def test_import_and_a_local_broker_need_no_pyarrow() -> None:
    code = BLOCK + (
        "import tensordepot, tensordepot.service.app as app; app.create_app(); print('ok')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_flight_options_without_pyarrow_say_what_to_install(tmp_path: object) -> None:
    code = BLOCK + (
        "from tensordepot.cli import main; "
        f"sys.exit(main(['serve', '--listen', 'unix://{tmp_path}/b.sock', "
        f"'--shm-prefix', '{TEST_PREFIX}nopa-', '--peer', 'grpc://127.0.0.1:1']))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 1 and "pip install 'tensordepot[flight]'" in res.stderr, res.stderr
