"""A nested state (dicts, lists, tensors, arrays, scalars, text, bytes) as an HDF5 group tree.

Used by checkpoints. Every container becomes a group and every leaf a dataset
(contiguous, unfiltered: weights do not compress and one large write is
fastest). How to rebuild each object is kept in one JSON index (dataset
`index` next to the tree: path -> kind and details), read once on load instead
of thousands of per-object attributes:

    dict          group (insertion order kept); its original keys in the index (int keys stay ints)
    list / tuple  group with children "0", "1", ...; all-int or all-float ones as one dataset
    torch.Tensor  dataset of its bytes; dtypes numpy lacks (bfloat16, float8) are stored as
                  same-width unsigned ints and viewed back on load
    np.ndarray    dataset as is (np scalar: 0-d dataset)
    int / float / bool / None / str / bytes / big int   scalar or uint8 dataset

Each leaf's bytes are hashed with XXH3-128 (about 17 GB/s, so verification costs a
few percent of the I/O; it detects corruption, it is not a cryptographic seal) and
the leaf digests, together with paths, kinds, dtypes and shapes, fold (SHA-256)
into one content checksum that load recomputes from what it read. Weight digests
meant for comparing runs use SHA-256 (`digest_weights`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np
import xxhash

try:  # torch is optional for the store: plain numpy states work without it
    import torch
except ImportError:  # pragma: no cover - torch is installed in every supported setup
    torch = None  # type: ignore[assignment]  # the module or None: mypy types the name as the module

# torch dtypes numpy cannot hold: stored as the unsigned int of the same width.
_NUMPY_LACKS = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "float8_e4m3fnuz": np.uint8,
    "float8_e5m2fnuz": np.uint8,
}
_INT64 = (-(1 << 63), (1 << 63) - 1)
_PREAD_MIN = 1 << 20  # datasets from this size on are read with preadv in threads
_READ_THREADS = 4


class StateTypeError(TypeError):
    """A value in a state that a checkpoint cannot hold; names its path."""


def _escape(key: str) -> str:
    if key == "":
        return "%"
    out = key.replace("%", "%25").replace("/", "%2F")
    return "%2E" if out == "." else out


def _bytes_of(arr: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")


CHECKSUM_ALGO = "xxh3-128 per leaf, folded with sha256"


class LeafHasher:
    """Collects leaf digests and folds them into the content checksum in canonical (sorted path) order."""

    def __init__(self) -> None:
        self.leaves: list[tuple[str, dict, str]] = []

    def add(self, path: str, info: dict, arr: np.ndarray) -> None:
        self.leaves.append((path, info, xxhash.xxh3_128(_bytes_of(arr)).hexdigest()))

    def finish(self, meta_json: str) -> str:
        total = hashlib.sha256(meta_json.encode())
        for path, info, digest in sorted(self.leaves, key=lambda t: t[0]):
            total.update(json.dumps([path, info, digest], sort_keys=True).encode())
        return total.hexdigest()


def tensor_parts(t) -> tuple[np.ndarray, str]:
    """(numpy array sharing the tensor's bytes, torch dtype name) for a CPU copy of `t`."""
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name in _NUMPY_LACKS:
        return t.view(getattr(torch, {1: "uint8", 2: "int16"}[t.element_size()])).numpy().view(_NUMPY_LACKS[name]), name
    return t.numpy(), name


def _typed_list(value) -> tuple[str, np.ndarray] | None:
    if not value:
        return None
    if all(type(v) is int for v in value) and _INT64[0] <= min(value) and max(value) <= _INT64[1]:
        return "int", np.asarray(value, np.int64)
    if all(type(v) is float for v in value):
        return "float", np.asarray(value, np.float64)
    return None


def write_tree(group: h5py.Group, state: Any, hasher: LeafHasher) -> None:
    """Write mapping `state` under `group`, plus the index that says how to read it back."""
    if not isinstance(state, dict):
        raise StateTypeError(f"the checkpoint state must be a dict, not {type(state).__name__}")
    index: dict[str, dict] = {}
    _write_value(group, "", state, hasher, index)
    blob = np.frombuffer(json.dumps(index).encode(), np.uint8)
    group.create_dataset("index", data=blob)


def _child(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _write_value(root: h5py.Group, path: str, value: Any, hasher: LeafHasher, index: dict) -> None:
    if isinstance(value, dict):
        names: dict[str, Any] = {}
        for key in value:
            if type(key) not in (str, int):
                raise StateTypeError(
                    f"/{path}: dict key {key!r} is a {type(key).__name__}; only str and int keys can be saved"
                )
            name = _escape(str(key))
            if name in names:
                raise StateTypeError(f"/{path}: keys {names[name]!r} and {key!r} would share the name '{name}'")
            names[name] = key
        root.create_group(f"tree/{path}" if path else "tree", track_order=True)
        index[path] = {"kind": "dict", "keys": list(value)}
        for name, key in names.items():
            _write_value(root, _child(path, name), value[key], hasher, index)
        return
    if isinstance(value, (list, tuple)):
        seq = "tuple" if isinstance(value, tuple) else "list"
        typed = _typed_list(value)
        if typed:
            _leaf(root, path, typed[1], {"kind": f"{seq}_{typed[0]}"}, hasher, index)
            return
        root.create_group(f"tree/{path}", track_order=True)
        index[path] = {"kind": seq, "len": len(value)}
        for i, child in enumerate(value):
            _write_value(root, _child(path, str(i)), child, hasher, index)
        return
    if torch is not None and isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise StateTypeError(f"/{path}: {value.layout} tensors cannot be saved; convert with .to_dense()")
        try:
            arr, dtype_name = tensor_parts(value)
        except (TypeError, RuntimeError, NotImplementedError) as exc:  # meta tensors, dtypes without numpy twin
            raise StateTypeError(
                f"/{path}: a {value.dtype} tensor on {value.device} cannot be saved "
                f"({str(exc).splitlines()[0]}); materialise or convert it first"
            ) from None
        _leaf(root, path, arr, {"kind": "torch", "torch_dtype": dtype_name}, hasher, index)
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise StateTypeError(f"/{path}: numpy arrays of Python objects cannot be saved; use a numeric dtype")
        _leaf(root, path, value, {"kind": "numpy"}, hasher, index)
    elif isinstance(value, np.generic):
        _leaf(root, path, np.asarray(value), {"kind": "npscalar"}, hasher, index)
    elif isinstance(value, bool):
        _leaf(root, path, np.asarray(value, np.bool_), {"kind": "bool"}, hasher, index)
    elif isinstance(value, int):
        if _INT64[0] <= value <= _INT64[1]:
            _leaf(root, path, np.asarray(value, np.int64), {"kind": "int"}, hasher, index)
        else:
            _leaf(root, path, np.frombuffer(str(value).encode(), np.uint8), {"kind": "bigint"}, hasher, index)
    elif isinstance(value, float):
        _leaf(root, path, np.asarray(value, np.float64), {"kind": "float"}, hasher, index)
    elif value is None:
        _leaf(root, path, np.zeros(0, np.uint8), {"kind": "none"}, hasher, index)
    elif isinstance(value, str):
        _leaf(root, path, np.frombuffer(value.encode(), np.uint8), {"kind": "str"}, hasher, index)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = np.frombuffer(bytes(value) if isinstance(value, memoryview) else value, np.uint8)
        _leaf(root, path, data, {"kind": "bytes"}, hasher, index)
    else:
        raise StateTypeError(
            f"/{path}: a {type(value).__name__} cannot be saved in a checkpoint; use tensors, arrays, "
            "numbers, str, bytes, and dicts/lists of them"
        )


def _leaf(root: h5py.Group, path: str, arr: np.ndarray, info: dict, hasher: LeafHasher, index: dict) -> None:
    ds = root.create_dataset(f"tree/{path}", shape=arr.shape, dtype=arr.dtype)
    if arr.size:
        ds.write_direct(np.ascontiguousarray(arr))
    index[path] = info
    hasher.add(path, {**info, "dtype": arr.dtype.str, "shape": list(arr.shape)}, arr)


def read_tree(group: h5py.Group, hasher: LeafHasher, fd: int | None = None) -> dict:
    """Read back what write_tree wrote. With `fd` (the file, opened by the caller) large contiguous
    datasets are read with preadv at their file offsets by a few threads: page faults and copies
    then run on several cores while h5py (which serialises its calls) is not involved."""
    index = json.loads(group["index"][()].tobytes())
    tree = group["tree"]
    leaves = [path for path, info in index.items() if info["kind"] not in ("dict", "list", "tuple")]
    arrays: dict[str, np.ndarray] = {}
    direct = []
    for path in leaves:
        ds = tree[path]
        arrays[path] = arr = np.empty(ds.shape, ds.dtype)
        offset = ds.id.get_offset() if arr.nbytes >= _PREAD_MIN and fd is not None else None
        if offset is not None and ds.compression is None and ds.chunks is None:
            direct.append((path, offset))
        elif arr.size:
            ds.read_direct(arr)
    if direct:
        assert fd is not None  # direct reads are planned only with a file descriptor
        with ThreadPoolExecutor(_READ_THREADS) as pool:
            list(pool.map(lambda job: _pread_into(fd, arrays[job[0]], job[1]), direct))
    for path in leaves:
        arr = arrays[path]
        hasher.add(path, {**index[path], "dtype": arr.dtype.str, "shape": list(arr.shape)}, arr)
    return _build(index, "", arrays)


def _pread_into(fd: int, arr: np.ndarray, offset: int) -> None:
    view = arr.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):  # preadv may return short counts (e.g. above 2 GiB)
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file reading {len(view)} bytes at offset {offset}")
        done += n


def _build(index: dict, path: str, arrays: dict[str, np.ndarray]) -> Any:
    info = index[path]
    kind = info["kind"]
    if kind == "dict":
        return {key: _build(index, _child(path, _escape(str(key))), arrays) for key in info["keys"]}
    if kind in ("list", "tuple"):
        items = [_build(index, _child(path, str(i)), arrays) for i in range(info["len"])]
        return tuple(items) if kind == "tuple" else items
    return _DECODE[kind](arrays[path], info)


def _torch_from(arr: np.ndarray, info: dict):
    name = info["torch_dtype"]
    t = torch.from_numpy(arr)
    return t.view(getattr(torch, name)) if name in _NUMPY_LACKS else t


_DECODE: dict[str, Callable[[np.ndarray, dict], Any]] = {
    "torch": _torch_from,
    "numpy": lambda a, i: a,
    "npscalar": lambda a, i: a[()],
    "int": lambda a, i: int(a),
    "float": lambda a, i: float(a),
    "bool": lambda a, i: bool(a),
    "none": lambda a, i: None,
    "bigint": lambda a, i: int(a.tobytes().decode()),
    "str": lambda a, i: a.tobytes().decode(),
    "bytes": lambda a, i: a.tobytes(),
    "list_int": lambda a, i: a.tolist(),
    "tuple_int": lambda a, i: tuple(a.tolist()),
    "list_float": lambda a, i: a.tolist(),
    "tuple_float": lambda a, i: tuple(a.tolist()),
}


def weights_from(state: dict) -> dict:
    """The model weights of a checkpoint state: state['model'] or state['weights'], else state itself."""
    for key in ("model", "weights"):
        if isinstance(state.get(key), dict):
            return state[key]
    return state


def digest_weights(weights: dict) -> str:
    """SHA-256 over (name, dtype, shape, SHA-256 of bytes) of every tensor/array, names sorted."""
    entries = []
    for name, value in weights.items():
        if torch is not None and isinstance(value, torch.Tensor):
            arr, dtype_name = tensor_parts(value)
        else:
            arr = np.asarray(value)
            dtype_name = arr.dtype.name
        entries.append((str(name), dtype_name, list(arr.shape), hashlib.sha256(_bytes_of(arr)).hexdigest()))
    total = hashlib.sha256()
    for entry in sorted(entries):
        total.update(json.dumps(list(entry)).encode())
    return total.hexdigest()
