"""Nested state dicts: ``put_state_dict(prefix, sd)`` and
``get_state_dict(prefix)``.

An optimizer's ``state_dict()`` is dicts (with int keys), lists, tuples,
numbers, strings, None and tensors.  The tensors go in one ``put_many``,
zero copy on the way out, each named ``prefix`` + its path
(``opt/state.0.exp_avg``; ``prefix#<n>`` where the path is no valid name);
everything else is the structure, JSON kept as a uint8 tensor named
``prefix + "__structure__"`` in the same batch, so a reader sees the whole
state dict of one put or none of it.  Names the previous state dict under
the prefix used and this one does not are deleted after the put.

``get_state_dict`` reads the structure, then gets it again with every
tensor it names in one ``get_many``: if another put came in between, it
reads that one instead.  Tensors come back as the kind they were put as
(torch tensors, numpy arrays: zero copy, read-only memory written
copy-on-write); others as ``SharedTensor``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._errors import InvalidRequest, InvalidType, TensorNotFound
from .._wire import is_name
from . import _batch, _ops
from ._checks import check_name
from ._core import Core
from ._http import Op
from ._source import raw_view

STRUCTURE = "__structure__"  # the name, under the prefix, of the structure
_TRIES = 8  # reads of a structure that keeps changing under get_state_dict


def _flatten(prefix: str, sd: Any) -> tuple[Any, dict[str, Any]]:
    """(the structure as JSON-able data, {tensor name: tensor})."""
    tensors: dict[str, Any] = {}

    def enc(x: Any, path: list[str]) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, dict):
            out = []
            for k, v in x.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise InvalidType(
                        f"state dict key {'.'.join([*path, repr(k)])} is a "
                        f"{type(k).__name__}: keys are str, int, float, bool "
                        f"or None"
                    )
                out.append([k, enc(v, [*path, str(k)])])
            return {"$d": out}
        if isinstance(x, (list, tuple)):
            items = [enc(v, [*path, str(i)]) for i, v in enumerate(x)]
            return {"$l" if isinstance(x, list) else "$u": items}
        if hasattr(x, "__dlpack__") or type(x).__module__ == "numpy":
            name = prefix + ".".join(path)
            if not path or name in tensors or not is_name(name) or name == prefix + STRUCTURE:
                name = f"{prefix}#{len(tensors)}"
            tensors[name] = x
            kind = type(x).__module__.split(".")[0]
            return {"$t": name, "k": kind if kind in ("torch", "numpy") else "shared"}
        raise InvalidType(
            f"state dict value {'.'.join(path) or '(the root)'} is a "
            f"{type(x).__module__}.{type(x).__name__}: a state dict holds tensors, "
            f"dicts, lists, tuples, str, int, float, bool and None"
        )

    return enc(sd, []), tensors


def _names(node: Any) -> list[str]:
    """The tensor names a structure holds, each checked (anyone with write
    access to the prefix may have put anything there)."""
    out: list[str] = []
    stack = [node]
    while stack:
        x = stack.pop()
        if not isinstance(x, dict):
            continue
        if "$t" in x:
            out.append(check_name(x["$t"], "a state dict's tensor name"))
        elif isinstance(x.get("$d"), list):
            for pair in x["$d"]:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise _bad(f"a dict item {str(pair)[:80]}")
                stack.append(pair[1])
        else:
            stack.extend(v for key in ("$l", "$u") if isinstance(x.get(key), list) for v in x[key])
    return out


def _bad(what: str) -> InvalidRequest:
    return InvalidRequest(
        f"a state dict's structure holds {what}, which put_state_dict never "
        f"writes: put the state dict again"
    )


def put_state_dict(core: Core, prefix: str, sd: Any, ttl: Any) -> Op[int]:
    """Put ``sd`` under ``prefix``: the version of its structure."""
    check_name(prefix + STRUCTURE, "prefix + __structure__")
    import numpy as np

    tree, tensors = _flatten(prefix, sd)
    text = json.dumps(tree, separators=(",", ":")).encode()
    old = yield from _structure_names(core, prefix)
    versions = yield from _batch.put_many(
        core, {**tensors, prefix + STRUCTURE: np.frombuffer(text, np.uint8)}, ttl, None
    )
    stale = sorted(set(old) - set(tensors))
    if stale:
        try:
            yield from _ops.delete_many(core, stale)
        except TensorNotFound:  # deleted meanwhile: name by name
            for name in stale:
                try:
                    yield from _ops.delete(core, name)
                except TensorNotFound:
                    pass
    return versions[prefix + STRUCTURE]


def _structure_names(core: Core, prefix: str) -> Op[list[str]]:
    """The tensor names the state dict under ``prefix`` uses now ([]: none)."""
    try:
        t = yield from _ops.get(core, prefix + STRUCTURE, 0.0, 0)
    except TensorNotFound:
        return []
    try:
        return _names(_parse(prefix, t))
    except InvalidRequest:
        return []  # not ours to read: leave its names alone
    finally:
        t.release()


def _parse(prefix: str, t: Any) -> Any:
    why = "it is not JSON text"
    try:
        if t.device == "cpu" and t.dtype == "uint8" and len(t.shape) == 1:
            return json.loads(bytes(raw_view(t)).decode())
        why = f"it is a {t.dtype} tensor of shape {list(t.shape)} on {t.device}"
    except RecursionError:
        why = "it nests too deeply"
    except ValueError:
        pass
    raise InvalidRequest(
        f"{prefix + STRUCTURE!r} is not a state dict's structure ({why}): "
        f"put the state dict again with put_state_dict"
    )


def get_state_dict(core: Core, prefix: str, timeout: Any) -> Op[Any]:
    """The state dict put under ``prefix``, rebuilt."""
    name = check_name(prefix + STRUCTURE, "prefix + __structure__")
    t = yield from _ops.get(core, name, timeout, 0)
    for _ in range(_TRIES):
        try:
            tree, version = _parse(prefix, t), t.version
        finally:
            t.release()
        try:
            got = yield from _batch.get_many(core, [name, *_names(tree)], 0.0, 0)
        except TensorNotFound:  # a new put deleted what the old structure named?
            t = yield from _ops.get(core, name, 0.0, 0)
            if t.version == version:
                t.release()
                raise
            continue
        t = got.pop(name)
        if t.version == version:
            t.release()
            return _build(tree, got)
        del got  # a new put came in between: read that one
    raise InvalidRequest(
        f"the state dict under {prefix!r} changed {_TRIES} times while it was "
        f"read; read it once its writer pauses"
    )


def _build(tree: Any, got: Mapping[str, Any]) -> Any:
    def dec(x: Any) -> Any:
        if not isinstance(x, dict):
            if isinstance(x, list):
                raise _bad("a bare list")
            return x
        if "$t" in x:
            t = got[x["$t"]]
            if x.get("k") == "torch":
                from torch.utils.dlpack import from_dlpack

                return from_dlpack(t)
            if x.get("k") == "numpy":
                import numpy as np

                return np.from_dlpack(t)
            return t
        if "$d" in x:
            return {k: dec(v) for k, v in x["$d"]}
        if "$l" in x:
            return [dec(v) for v in x["$l"]]
        if "$u" in x:
            return tuple(dec(v) for v in x["$u"])
        raise _bad(str(x)[:80])

    try:
        return dec(tree)
    except (TypeError, ValueError, KeyError, RecursionError):
        raise _bad("what no state dict holds") from None
