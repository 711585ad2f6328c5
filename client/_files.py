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

import contextlib
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from .._defaults import parse_size
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
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
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
    return InvalidRequest(
        f"{path} changed while it was read (it is shorter than its header "
        f"says now); load it again once its writer is done"
    )


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
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _bad(path, "its __metadata__ is not a map of strings")
    size, out = size - 8 - n, []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} needs exactly dtype, shape and data_offsets")
        dtype = info["dtype"]
        ours = DTYPES.get(dtype) if isinstance(dtype, str) else None
        if ours is None:
            raise _bad(
                path,
                f"tensor {name!r} has dtype {str(dtype)[:40]!r}; tensordepot "
                f"stores {', '.join(DTYPES)}",
            )
        shape, span = info["shape"], info["data_offsets"]
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_NDIM
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(span, list)
            and len(span) == 2
            and all(type(x) is int for x in span)
            and 0 <= span[0] <= span[1] <= size
        ):
            raise _bad(
                path,
                f"tensor {name!r} has shape {str(shape)[:100]} and data_offsets "
                f"{str(span)[:100]} (at most {MAX_NDIM} dimensions, within the "
                f"file)",
            )
        if span[1] - span[0] != math.prod(shape) * dtype_from_name(ours).itemsize:
            raise _bad(
                path,
                f"tensor {name!r} of shape {shape} and dtype {dtype} "
                f"spans {span[1] - span[0]} bytes",
            )
        out.append((name, ours, shape, 8 + n + span[0], 8 + n + span[1]))
    return meta, out


Paths = Any  # a path, or a list of paths
INDEX = ".safetensors.index.json"  # how a sharded checkpoint's index ends


def shard_files(path: Paths) -> tuple[list[str], dict[str, str] | None]:
    """The files that ``path`` names, and the index's map of tensor name to
    file if it is an index: a safetensors file; a folder (its index if it has
    one, else every ``*.safetensors`` in it); an index JSON
    (``model.safetensors.index.json``, as ``save_pretrained`` writes); or a
    list of files."""
    if isinstance(path, (list, tuple)):
        files = [os.fspath(p) for p in path]
        if not files:
            raise InvalidRequest("load_file was given an empty list of files")
        return files, None
    path = os.fspath(path)
    if os.path.isdir(path):
        listed = sorted(os.listdir(path))
        indexes = [f for f in listed if f.endswith(INDEX)]
        if len(indexes) > 1:
            raise InvalidRequest(
                f"{path} holds {len(indexes)} indexes ({', '.join(indexes)}): name the one to load"
            )
        if indexes:
            return shard_files(os.path.join(path, indexes[0]))
        files = [os.path.join(path, f) for f in listed if f.endswith(".safetensors")]
        if not files:
            raise InvalidRequest(
                f"{path} is a folder with no *.safetensors file and no "
                f"*{INDEX}: name a safetensors file, an index or a folder "
                f"of shards"
            )
        return files, None
    if not path.endswith(".json"):
        return [path], None
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read(_MAX_HEADER + 1))
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        index = None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not (
        isinstance(wmap, dict)
        and wmap
        and all(
            isinstance(v, str) and v == os.path.basename(v) and v not in ("", ".", "..")
            for v in wmap.values()
        )
    ):
        raise InvalidRequest(
            f'{path} is not a safetensors index: it needs a "weight_map" of '
            f"tensor names to shard file names in its folder"
        )
    folder = os.path.dirname(path)
    files = [os.path.join(folder, f) for f in dict.fromkeys(wmap.values())]
    return files, {k: os.path.join(folder, v) for k, v in wmap.items()}


def load_file(
    core: Core, path: Paths, prefix: str, ttl: Any, progress: Progress | None
) -> Op[dict[str, int]]:
    """Every tensor of ``path`` (a file, the shards of a folder or of an
    index, a list of files) as ``prefix + its name``, in one batch: the
    versions.  The files' ``__metadata__`` maps are merged.

    The files are read, not mapped (``FileSpan``): a file that shrinks while
    it is copied is an error, where a mapping would die of SIGBUS."""
    paths, wmap = shard_files(path)
    ttl = check_ttl(ttl)
    import numpy as np

    with contextlib.ExitStack() as stack:
        names: list[str] = []
        arrays: list[Any] = []
        shapes: list[list[int]] = []
        dtypes: list[str] = []
        meta: dict[str, str] | None = None
        seen: dict[str, str] = {}
        by_fd: dict[int, str] = {}
        for p in paths:
            fd = _open(stack, p)
            by_fd[fd] = p
            try:
                more, items = read_header(p, fd, os.fstat(fd).st_size)
            except OSError as exc:
                raise InvalidRequest(f"cannot read {p}: {exc.strerror}") from None
            if more is not None:
                meta = {**more, **(meta or {})}
            for name, dtype, shape, start, end in items:
                if name in seen:
                    raise InvalidRequest(
                        f"tensor {name!r} is in both {seen[name]} and {p}: "
                        f"load them one at a time, under two prefixes"
                    )
                if wmap is not None and wmap.get(name) != p:
                    where = f"puts in {wmap[name]}" if name in wmap else "does not name"
                    raise InvalidRequest(f"{p} holds tensor {name!r}, which its index {where}")
                seen[name] = p
                names.append(check_name(prefix + name, "prefix + tensor name"))
                arrays.append(FileSpan(fd, start, end - start))
                shapes.append(shape)
                dtypes.append(dtype)
        if wmap is not None and len(seen) != len(wmap):
            lost = next(k for k in wmap if k not in seen)
            raise InvalidRequest(
                f"the index names tensor {lost!r} in {wmap[lost]}, which does not hold it"
            )
        if meta is not None:
            names.append(check_name(prefix + METADATA, "prefix + __metadata__"))
            arrays.append(np.frombuffer(json.dumps(meta).encode(), np.uint8))
            shapes.append([arrays[-1].size])
            dtypes.append("uint8")
        if not names:
            return {}
        try:
            return (yield from put_arrays(core, names, arrays, shapes, dtypes, ttl, progress))
        except FileChanged as exc:
            raise _changed(by_fd.get(exc.fd, str(paths))) from None
        except OSError as exc:
            raise InvalidRequest(
                f"cannot read {paths[0] if len(paths) == 1 else paths}: {exc.strerror}"
            ) from None


def _open(stack: contextlib.ExitStack, path: str) -> int:
    """An open regular file's descriptor, closed with ``stack``."""
    try:
        f = stack.enter_context(open(path, "rb"))  # noqa: SIM115 (the stack closes it)
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InvalidRequest(f"cannot read {path}: not a regular file")
    except OSError as exc:  # missing, a directory, an I/O error
        raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
    return f.fileno()


WEIGHTS = "model"  # shards are model-00001-of-00005.safetensors, as save_pretrained names them


def save_file(
    core: Core,
    prefix: str,
    path: Any,
    progress: Progress | None,
    max_shard_size: int | str | None = None,
) -> Op[int]:
    """The tensors named ``prefix...`` written to ``path`` (names without the
    prefix): the bytes of tensors written.  With ``max_shard_size``, ``path``
    is a folder that gets shards of at most that many bytes (a larger tensor
    alone in its shard) and ``model.safetensors.index.json``, as
    ``save_pretrained`` writes them."""
    path = os.fspath(path)
    if max_shard_size is not None:
        try:
            max_shard_size = parse_size(max_shard_size)
        except ValueError:
            max_shard_size = 0
        if max_shard_size <= 0:
            raise InvalidRequest(
                f"max_shard_size must be a size > 0 (5GB, 500MiB, bytes), not {max_shard_size!r}"
            )
    listed = [i for i in (yield from list_names(core, prefix)) if i.state == "ready"]
    names = [i.name for i in listed]
    if not names:
        raise InvalidRequest(f"no published tensor name starts with {prefix!r}: nothing to save")
    got = yield from get_many(core, names, 0.0, 0)
    try:
        written: int = yield Offload(_write, got, prefix, path, progress, max_shard_size)
    finally:
        del got
    return written


def _write(
    got: dict[str, Any],
    prefix: str,
    path: str,
    progress: Progress | None,
    max_shard_size: int | None,
) -> int:
    meta = got.pop(prefix + METADATA, None)
    metadata = None if meta is None else _metadata(prefix, meta)
    shards: list[list[tuple[str, Any]]] = [[]]
    size = total = 0
    for name in sorted(got):
        t = got[name]
        if t.device != "cpu":
            raise InvalidRequest(
                f"tensor {name!r} is on {t.device}: save_file writes CPU "
                f"tensors; put a CPU copy first"
            )
        if t.dtype not in _NAMES:
            raise InvalidRequest(
                f"tensor {name!r} has dtype {t.dtype}, which safetensors does "
                f"not store (it stores {', '.join(_NAMES)})"
            )
        if max_shard_size is not None and shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name.removeprefix(prefix), t))
        size += t.nbytes
        total += t.nbytes
    done = [0, total]
    if max_shard_size is None:
        _write_one(path, metadata, shards[0], progress, done)
        return total
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise InvalidRequest(f"cannot make the folder {path}: {exc.strerror}") from None
    n, wmap = len(shards), {}
    files = [f"{WEIGHTS}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for file, shard in zip(files, shards, strict=True):
        _write_one(os.path.join(path, file), metadata, shard, progress, done)
        wmap.update(dict.fromkeys((name for name, _ in shard), file))
    index = {"metadata": {"total_size": total}, "weight_map": wmap}
    _replace(
        os.path.join(path, WEIGHTS + INDEX),
        [json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"],
    )
    stale = re.compile(re.escape(WEIGHTS) + r"-\d{5}-of-\d{5}\.safetensors")
    for old in os.listdir(path):  # the shards of an earlier save, which the index no longer names
        if stale.fullmatch(old) and old not in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, old))
    return total


def _write_one(
    path: str,
    metadata: dict[str, str] | None,
    items: list[tuple[str, Any]],
    progress: Progress | None,
    done: list[int],
) -> None:
    """One safetensors file of ``items``; ``done`` is [bytes written, of all]."""
    header: dict[str, Any] = {} if metadata is None else {METADATA: metadata}
    offset = 0
    for name, t in items:
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start 8-aligned, as the library writes them

    def chunks() -> Any:
        yield len(text).to_bytes(8, "little") + text
        for _, t in items:
            yield raw_view(t).reshape(-1).view("uint8").data
            done[0] += t.nbytes
            if progress is not None:
                progress(done[0], done[1])

    _replace(path, chunks())


def _replace(path: str, chunks: Any) -> None:
    """``path`` replaced by a file of ``chunks``: it exists whole or not at all."""
    tmp = ""
    try:
        # The temporary file is made O_EXCL|O_NOFOLLOW under a random name
        # (mkstemp), in the target's directory: in a shared sticky directory
        # another user can plant neither a symlink nor a file where it goes.
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or "."
        )
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o666 & ~_umask())  # the mode open() would give the file
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
        tmp = ""
    except OSError as exc:
        raise InvalidRequest(f"cannot write {path}: {exc.strerror}") from None
    finally:
        if tmp:
            os.unlink(tmp)


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
    raise InvalidRequest(
        f"{prefix + METADATA!r} is not a safetensors file's metadata ({why}): "
        f"delete it, or put the metadata as a JSON map of strings (uint8)"
    )


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
