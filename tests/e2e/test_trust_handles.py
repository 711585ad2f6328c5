"""What the client believes of a broker, and what it takes from its caller.

A handle whose geometry reaches outside its bytes or its segment is refused
with ``TensorBroken`` before anything is mapped, and its lease is given back
(a fake broker on a unix socket hands out crafted handles into a real
segment made with the project's shm code); a put of a tensor held from a
broker that was killed and restarted copies it, the first time; a masked
numpy array is refused, whatever its size, by both clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from tensordepot import AsyncClient, InvalidRequest

MiB = 1 << 20


def drained(b: BrokerProc) -> None:
    """No lease, no version, no byte in use at the broker (releases go in the background)."""

    def idle() -> bool:
        st = b.stat()
        return st.leases == 0 and st.versions == 0 and st.bytes_in_use == 0

    wait_for(idle, 10, what="no leases, versions or bytes at the broker")


# -- masked arrays ------------------------------------------------------------------------------


def masked(n: int) -> Any:
    data = np.arange(n, dtype=np.float32)
    return np.ma.masked_array(data, mask=data % 2 == 0, fill_value=-1.0)


def _puts(c: Any, x: Any) -> list[Callable[[], Any]]:
    return [lambda: c.put("m", x), lambda: c.put_many({"ok": np.zeros(3), "m": x})]


@pytest.mark.parametrize("n", [pytest.param(1000, id="inline"), pytest.param(MiB, id="alloc")])
def test_a_masked_array_is_refused_by_put_and_put_many(broker: BrokerProc, n: int) -> None:
    x = masked(n)
    with broker.client() as c:
        for call in _puts(c, x):
            with pytest.raises(InvalidRequest) as err:
                call()
            msg = str(err.value)
            assert "masked" in msg and ".filled(" in msg and ".data" in msg, msg
        assert c.list() == []

        async def main() -> None:
            async with AsyncClient(broker.url) as ac:
                for coro in (lambda: ac.put("m", x), lambda: ac.put_many({"m": x})):
                    with pytest.raises(InvalidRequest, match=r"\.filled\("):
                        await coro()
                # What the message says to do works.
                await ac.put("filled", x.filled(0.0))
                await ac.put("data", x.data)
                got = await ac.get_many(["filled", "data"])
                assert np.array_equal(np.from_dlpack(got["filled"]), x.filled(0.0))
                assert np.array_equal(np.from_dlpack(got["data"]), x.data)
                del got
                for name in ("filled", "data"):
                    await ac.delete(name)

        asyncio.run(main())
    drained(broker)
