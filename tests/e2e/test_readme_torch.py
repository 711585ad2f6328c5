"""The README's "Using it with PyTorch" examples run as written: each one as a
script of its own, against a real broker ($TENSORDEPOT_URL), and leaves no
name, lease or session behind (the broker fixture checks the last two and
/dev/shm at teardown)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import ROOT, BrokerProc, wait_for

README = (ROOT / "README.md").read_text()


def example(name: str) -> str:
    found = re.search(rf"<!-- torch-example:{name} -->\n```python\n(.*?)```", README, re.DOTALL)
    assert found, f"the README has no torch example {name!r}"
    return found.group(1)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (
            "dataloader",
            [
                "torch.Size([4, 16]) [0.0, 1.0, 2.0, 3.0]",
                "torch.Size([4, 16]) [4.0, 5.0, 6.0, 7.0]",
            ],
        ),
        ("queue", ["worker read 523776.0", "done: 1"]),
        ("tied", ["one tensor: True", "same logits: True"]),
        ("dcp", ["restored: True 100", "zero copy: True"]),
        (
            "safetensors",
            [
                "['llama/__metadata__', 'llama/embed', 'llama/head']",
                "served: True",
                "round trip: True",
            ],
        ),
    ],
)
def test_the_readme_torch_example_runs(
    broker: BrokerProc, tmp_path: Path, name: str, says: list[str]
) -> None:
    script = tmp_path / f"readme_{name}.py"  # not queue.py: that would shadow the stdlib
    script.write_text(example(name))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDEPOT_")}
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**env, "TENSORDEPOT_URL": broker.url},
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == says, res.stdout
    with broker.client() as c:
        assert c.list() == []
        wait_for(
            lambda: c.stat().sessions == 1 and c.stat().leases == 0,
            30,
            what="the example's sessions and leases to end",
        )
