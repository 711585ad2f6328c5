"""Schemathesis over every OpenAPI route of a live broker, over TCP with a token.

The standard tool for what tests/service/test_routes.py's hypothesis fuzz
does by hand, run against a real ``tensordepot serve``: generate requests
from the OpenAPI document, valid and not, and check that the broker never
answers 5xx (except the documented 503 and 507), answers only the statuses
and content types it documents, and that every body matches its documented
schema.  Bounded to about two minutes in all
(``TENSORDEPOT_SCHEMATHESIS_EXAMPLES`` examples per route, 40 by default).

Two requests in three carry an admin token, the third a write token limited
to names starting with "w"; half carry a real session (the others a made-up
one), so they reach the broker's own checks rather than stopping at
authentication.  Long polls are capped at 0.2 s.
"""

from __future__ import annotations

import os
import secrets
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from _harness import BrokerProc, free_port
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tensordepot.service import Settings, create_app

EXAMPLES = int(os.environ.get("TENSORDEPOT_SCHEMATHESIS_EXAMPLES", "40"))
SESSION = "x-tensordepot-session"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


class Live:
    def __init__(self, tmp: str) -> None:
        self.token, team = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        tokens = os.path.join(tmp, "tokens")
        with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(f"{team} write prefix=w name=team\n")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.broker = BrokerProc(
            "--listen",
            self.base,
            "--max-memory",
            "64MiB",
            "--segment-size",
            "4MiB",
            "--session-ttl",
            "1",
            "--token-file",
            tokens,
            env={"TENSORDEPOT_TOKEN": self.token},
        )
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.team = {"Authorization": f"Bearer {team}"}
        try:
            self._start_session()
        except BaseException:
            self.broker.cleanup()  # a broker that cannot serve the fuzz must not outlive it
            raise

    def _start_session(self) -> None:
        # Over TCP every session lives on heartbeats (a claimed pid is never
        # trusted): ours is kept alive by a thread, and the sessions the fuzz
        # opens lapse within a second.
        r = requests.post(
            f"{self.base}/v1/sessions", json={"pid": os.getpid()}, headers=self.auth, timeout=30
        )
        assert r.status_code == 200, r.text
        assert not r.json()["tracked"], r.json()
        self.sid: str = r.json()["session"]
        self.stop = threading.Event()
        self.beat = threading.Thread(target=self._beat, daemon=True)
        self.beat.start()

    def _beat(self) -> None:
        with requests.Session() as http:
            while not self.stop.wait(0.2):
                http.post(
                    f"{self.base}/v1/sessions/{self.sid}/heartbeat",
                    headers={**self.auth, SESSION: self.sid},
                    timeout=30,
                )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    lv = Live(str(tmp_path_factory.mktemp("schemathesis")))
    try:
        served = requests.get(f"{lv.base}/openapi.json", headers=lv.auth, timeout=30).json()
        assert served == DOC, "the broker serves the document the cases were generated from"
        yield lv
        lv.stop.set()
        lv.beat.join(30)
        requests.delete(
            f"{lv.base}/v1/sessions/{lv.sid}", headers={**lv.auth, SESSION: lv.sid}, timeout=30
        )
        lv.broker.check_clean()
        assert lv.broker.stop() == 0, lv.broker.log()
        assert lv.broker.segments() == []
        assert "Traceback" not in lv.broker.log(), lv.broker.log()
    finally:
        lv.broker.cleanup()


# Generated from the app's own document, which the live broker serves (the
# fixture checks): pytest collects the cases before any broker runs.
DOC = create_app(Settings(token="", insecure_no_auth=False)).openapi()
schema = schemathesis.openapi.from_dict(DOC)


def _tame(case: Any, live: Live) -> dict[str, str]:
    """A real session for half the cases and the prefix token for a third
    (decided by the case's own content, so a failure reproduces), and no long
    poll beyond 0.2 s.  Returns the credentials to send."""
    digest = zlib.crc32(repr((case.body, case.path_parameters, case.query)).encode())
    headers = case.headers if case.headers is not None else {}
    if SESSION in headers and digest % 2:
        headers[SESSION] = live.sid
    query = case.query or {}
    try:
        if float(query.get("timeout", 0)) > 0.2:
            query["timeout"] = 0.2
    except (TypeError, ValueError, OverflowError):
        pass
    body = case.body
    if isinstance(body, dict) and "timeout" in body:
        t = body["timeout"]
        if t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0.2):
            body["timeout"] = 0.2
    return live.team if digest % 3 == 0 else live.auth


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_every_route_conforms_and_never_fails(case: Any, live: Live) -> None:
    credentials = _tame(case, live)
    case.call_and_validate(base_url=live.base, headers=credentials, checks=CHECKS, timeout=30)
