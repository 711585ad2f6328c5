"""A host version's handle as JSON (``_render.handle_json``) is encoded from
its fields, without the model: it must be, byte for byte, what the
``Handle`` model writes, for every state, lease and shape, and the same
again when a published version's JSON is reused around another lease.

The real registry in this process, on real shared memory.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import pytest
from _harness import TEST_PREFIX, shm_entries
from tensordepot._wire import AllocRequest, Handle
from tensordepot.service import Broker
from tensordepot.service._http._render import handle, handle_json
from tensordepot.service._registry._sessions import Caller
from tensordepot.shm._pool import Pool

MiB = 1 << 20
WHO = Caller("uid:0", 1)


@pytest.fixture
def broker() -> Iterator[Broker]:
    prefix = f"{TEST_PREFIX}render-{secrets.token_hex(4)}-"
    b = Broker(Pool(prefix, max_memory=8 * MiB, segment_size=1 * MiB, prefault=False))
    try:
        yield b
    finally:
        b.close()
        assert shm_entries(prefix) == []


def _same(broker: Broker, v: object, lease: int | None) -> bytes:
    made = handle_json(broker, v, lease)  # type: ignore[arg-type]
    model = handle(broker, v, lease).model_dump_json().encode()  # type: ignore[arg-type]
    assert made == model
    assert Handle.model_validate_json(made).lease == lease
    return made


@pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        ("t", [2, 3], "float32"),
        ("layers.0/w", [], "int8"),  # a 0-d tensor
        ('a"quoted"\\name<&>', [4, 0, 5], "bfloat16"),  # JSON escapes, no elements
        ("big", [1 << 10, 1 << 8], "complex128"),
    ],
)
def test_a_host_handles_json_is_what_the_model_writes(
    broker: Broker, name: str, shape: list[int], dtype: str
) -> None:
    sid = broker.open_session(WHO).session
    req = AllocRequest(name=name, shape=shape, dtype=dtype, hold=True)
    v, hold = asyncio.run(broker.alloc(sid, WHO, req))
    assert hold is not None
    writing = _same(broker, v, hold)
    assert b'"state":"writing"' in writing
    published = broker.publish(sid, WHO, name, v.number)
    first = _same(broker, published, None)
    assert b'"state":"ready"' in first and b'"lease":null' in first
    leased = broker.try_get(sid, WHO, name)
    assert leased is not None
    again = _same(broker, *leased)  # from the JSON kept since the first
    assert again == first.replace(b'"lease":null', b'"lease":%d' % leased[1])
    assert _same(broker, published, None) == first
