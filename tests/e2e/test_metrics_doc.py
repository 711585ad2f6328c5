"""Every metric family a real broker serves (with --flight too) is named in
the README, under its full name or, for a counter, as the event of
``tensordepot_<event>_total``: a new family cannot go undocumented."""

from __future__ import annotations

import re
from collections.abc import Callable

from _harness import ROOT, BrokerProc
from _workerio import http_get


def _families(broker: BrokerProc) -> set[str]:
    text = http_get(broker.url, "/metrics")[2]
    return {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}


def test_every_metric_family_is_documented(broker_factory: Callable[..., BrokerProc]) -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(tensordepot_[a-z0-9_]+)", readme))
    events = set(re.findall(r"`([a-z0-9_]+)`", readme))
    families = _families(broker_factory()) | _families(
        broker_factory("--flight", "grpc://127.0.0.1:0", "--insecure-no-auth")
    )
    assert len(families) > 30, families
    missing = sorted(
        f
        for f in families
        if f not in named
        and not (
            f.endswith("_total") and f.removeprefix("tensordepot_").removesuffix("_total") in events
        )
    )
    assert not missing, f"metric families the README does not name: {missing}"
