"""safetensors files in and out: ``load_file`` puts every tensor of a file in
one batch, ``save_file`` writes the tensors under a prefix back out.

The format (https://github.com/huggingface/safetensors) is 8 bytes of
header length (little-endian), a JSON header naming each tensor's dtype,
shape and byte range (and a ``__metadata__`` map of strings), then the bytes.
The header is read here and each tensor is read with ``preadv`` straight
into broker memory, so it is copied once, from the page cache, whatever its
dtype: the
safetensors package hands numpy no bfloat16 or float8 without torch.  The
file's ``__metadata__`` is kept as a uint8 tensor of its JSON, named
``<prefix>__metadata__``, which ``save_file`` writes back as metadata.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from .._errors import InvalidRequest
from .._wire import MAX_NDIM
from ..shm import dtype_from_name
from ..shm._copy import FileChanged, FileSpan
from ._batch import get_many, put_arrays
from ._checks import check_name, check_ttl
from ._core import Core
from ._http import Offload, Op
from ._ops import names as list_names
from ._source import raw_view

METADATA = "__metadata__"  # the name, under the prefix, of the file's metadata
_MAX_HEADER = 100 << 20  # the safetensors library's own limit
# safetensors' dtype names -> ours
DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
          "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
          "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
_NAMES = {v: k for k, v in DTYPES.items()}
Progress = Callable[[int, int], None]


def _bad(path: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{path} is not a safetensors file tensordepot can read: {why}")


Item = tuple[str, str, list[int], int, int]  # name, our dtype, shape, start, end (in the file)


def _pread(path: str, fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise _changed(path)
    return data


def _changed(path: str) -> InvalidRequest:
    return InvalidRequest(f"{path} changed while it was read (it is shorter than its header "
                          f"says now); load it again once its writer is done")


def read_header(path: str, fd: int, size: int) -> tuple[dict[str, str] | None, list[Item]]:
    """(metadata, [(name, our dtype, shape, start, end)]) of an open file of
    ``size`` bytes, every range checked against the file and the dtype's item
    size, and nothing in the header trusted: whatever it holds is this
    error or that, an ``InvalidRequest`` naming the file."""
    if size < 8:
        raise _bad(path, f"it has {size} bytes, fewer than its 8-byte header length")
    n = int.from_bytes(_pread(path, fd, 8, 0), "little")
    if n > _MAX_HEADER or 8 + n > size:
        raise _bad(path, f"its header claims {n} bytes, and the file has {size}")
    try:
        header = json.loads(_pread(path, fd, n, 8))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(path, f"its header is not JSON ({exc})") from None
    except RecursionError:
        raise _bad(path, "its header nests too deeply") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    meta = header.pop(METADATA, None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "its __metadata__ is not a map of strings")
    size, out = size - 8 - n, []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} needs exactly dtype, shape and data_offsets")
        dtype = info["dtype"]
        ours = DTYPES.get(dtype) if isinstance(dtype, str) else None
        if ours is None:
            raise _bad(path, f"tensor {name!r} has dtype {str(dtype)[:40]!r}; tensordepot "
                             f"stores {', '.join(DTYPES)}")
        shape, span = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(span, list) and len(span) == 2
                and all(type(x) is int for x in span) and 0 <= span[0] <= span[1] <= size):
            raise _bad(path, f"tensor {name!r} has shape {str(shape)[:100]} and data_offsets "
                             f"{str(span)[:100]} (at most {MAX_NDIM} dimensions, within the "
                             f"file)")
        if span[1] - span[0] != math.prod(shape) * dtype_from_name(ours).itemsize:
            raise _bad(path, f"tensor {name!r} of shape {shape} and dtype {dtype} "
                             f"spans {span[1] - span[0]} bytes")
        out.append((name, ours, shape, 8 + n + span[0], 8 + n + span[1]))
    return meta, out


def load_file(core: Core, path: Any, prefix: str, ttl: Any,
              progress: Progress | None) -> Op[dict[str, int]]:
    """Every tensor of ``path`` as ``prefix + its name``, in one batch: the versions.

    The file is read, not mapped (``FileSpan``): a file that shrinks while it
    is copied is an error, where a mapping would die of SIGBUS."""
    path, ttl = os.fspath(path), check_ttl(ttl)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, after the copy)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
    import numpy as np

    with f:
        fd = f.fileno()
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"cannot read {path}: not a regular file")
            meta, items = read_header(path, fd, st.st_size)
        except OSError as exc:  # a directory, an I/O error
            raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
        names = [check_name(prefix + name, "prefix + tensor name") for name, *_ in items]
        arrays: list[Any] = [FileSpan(fd, start, end - start) for _, _, _, start, end in items]
        shapes, dtypes = [shape for _, _, shape, *_ in items], [d for _, d, *_ in items]
        if meta is not None:
            names.append(check_name(prefix + METADATA, "prefix + __metadata__"))
            arrays.append(np.frombuffer(json.dumps(meta).encode(), np.uint8))
            shapes.append([arrays[-1].size])
            dtypes.append("uint8")
        if not names:
            return {}
        try:
            return (yield from put_arrays(core, names, arrays, shapes, dtypes, ttl, progress))
        except FileChanged:
            raise _changed(path) from None
        except OSError as exc:
            raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None


def save_file(core: Core, prefix: str, path: Any, progress: Progress | None) -> Op[int]:
    """The tensors named ``prefix...`` written to ``path`` (names without the
    prefix): the bytes of tensors written."""
    path = os.fspath(path)
    listed = [i for i in (yield from list_names(core, prefix)) if i.state == "ready"]
    names = [i.name for i in listed]
    if not names:
        raise InvalidRequest(f"no published tensor name starts with {prefix!r}: nothing to save")
    got = yield from get_many(core, names, 0.0, 0)
    try:
        written: int = yield Offload(_write, got, prefix, path, progress)
    finally:
        del got
    return written


def _write(got: dict[str, Any], prefix: str, path: str, progress: Progress | None) -> int:
    meta = got.pop(prefix + METADATA, None)
    header: dict[str, Any] = {}
    if meta is not None:
        header[METADATA] = _metadata(prefix, meta)
    offset, order = 0, []
    for name in sorted(got):
        t = got[name]
        if t.device != "cpu":
            raise InvalidRequest(f"tensor {name!r} is on {t.device}: save_file writes CPU "
                                 f"tensors; put a CPU copy first")
        st = _NAMES.get(t.dtype)
        if st is None:
            raise InvalidRequest(f"tensor {name!r} has dtype {t.dtype}, which safetensors does "
                                 f"not store (it stores {', '.join(_NAMES)})")
        header[name.removeprefix(prefix)] = {"dtype": st, "shape": list(t.shape),
                                             "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        order.append(t)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start 8-aligned, as the library writes them
    done, tmp = 0, ""
    try:
        # The temporary file is made O_EXCL|O_NOFOLLOW under a random name
        # (mkstemp), in the target's directory: in a shared sticky directory
        # another user can plant neither a symlink nor a file where it goes.
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp", dir=os.path.dirname(path) or ".")
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o666 & ~_umask())  # the mode open() would give the file
            f.write(len(text).to_bytes(8, "little") + text)
            for t in order:
                f.write(raw_view(t).reshape(-1).view("uint8").data)
                done += t.nbytes
                if progress is not None:
                    progress(done, offset)
        os.replace(tmp, path)  # a file that exists is whole
        tmp = ""
    except OSError as exc:
        raise InvalidRequest(f"cannot write {path}: {exc.strerror}") from None
    finally:
        if tmp:
            os.unlink(tmp)
    return offset


def _metadata(prefix: str, meta: Any) -> dict[str, str]:
    """What ``<prefix>__metadata__`` holds, if it is what ``load_file`` puts
    there (a map of strings, as JSON): anyone with write access to the
    prefix may have put anything there."""
    why = "it is not JSON text"
    try:
        if meta.device == "cpu" and meta.dtype == "uint8" and len(meta.shape) == 1:
            value = json.loads(bytes(raw_view(meta)).decode())
            if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                return value
            why = "it is not a map of strings"
        else:
            why = f"it is a {meta.dtype} tensor of shape {list(meta.shape)} on {meta.device}"
    except RecursionError:
        why = "it nests too deeply"
    except ValueError:  # not UTF-8, not JSON
        pass
    raise InvalidRequest(f"{prefix + METADATA!r} is not a safetensors file's metadata ({why}): "
                         f"delete it, or put the metadata as a JSON map of strings (uint8)")


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it,
    for every thread at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o077  # unknown: the file stays private
