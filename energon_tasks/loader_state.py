"""Energon loader state <-> plain JSON data: what a training checkpoint stores of each reader.

This module owns the safe form of ``SavableDataLoader.save_state_rank()``. That state is a tree
of Energon's state dataclasses (``SavableDataLoaderState``, ``SavableDatasetCheckpoint``,
``SliceState``, ...), ``FlexState`` dicts, tuples, bytes, numpy arrays and torch tensors (RNG
states, restore keys of the samples in shuffle and packing buffers). ``to_plain`` turns it into
JSON-ready data (lists, dicts, strings, numbers) with tagged values; ``from_plain`` rebuilds it
exactly. Only Energon's own state dataclasses (looked up among the already imported
``megatron.energon`` modules) and those plain types are accepted: nothing is unpickled, imported
or called from the data. Anything else raises ``LoaderStateError`` (one line).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import sys
from typing import Any

import numpy as np
import torch

#: The key that tags a non-JSON value: {"__t": kind, ...}.
TAG = "__t"
_ENERGON = "megatron.energon."


class LoaderStateError(ValueError):
    """The data is not a loader state this module wrote."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def to_plain(value: Any) -> Any:
    """A loader state (or any tree of the types above) as JSON-ready data.

    Raises:
        LoaderStateError: a value of a type this format does not hold.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [to_plain(v) for v in value]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "v": _b64(value)}
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous().numpy()
        return {TAG: "tensor", "dtype": str(array.dtype), "shape": list(array.shape),
                "v": _b64(array.tobytes())}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(value)
        return {TAG: "ndarray" if isinstance(value, np.ndarray) else "npscalar",
                "dtype": str(array.dtype), "shape": list(array.shape), "v": _b64(array.tobytes())}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {TAG: "state", "class": f"{cls.__module__}:{cls.__qualname__}",
                "v": {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        kind = "dict" if type(value) is dict else _class_name(type(value))
        return {TAG: kind, "v": [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    raise LoaderStateError(f"loader state holds a {type(value).__name__}, which the checkpoint "
                           "format does not store")


def _class_name(cls: type) -> str:
    if not cls.__module__.startswith(_ENERGON):
        raise LoaderStateError(f"loader state holds a {cls.__qualname__} ({cls.__module__})")
    return f"{cls.__module__}:{cls.__qualname__}"


def _energon_class(name: Any) -> type:
    """An Energon state class by "module:qualname", among the modules already imported."""
    module, _, qualname = str(name).partition(":")
    found = sys.modules.get(module) if module.startswith(_ENERGON) else None
    for part in qualname.split(".") if found is not None else ():
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise LoaderStateError(f"unknown state class {name!r} (only Energon's own are accepted)")
    return found


def _array(item: dict) -> np.ndarray:
    dtype = np.dtype(item["dtype"])
    if dtype.hasobject:
        raise LoaderStateError("object arrays are not accepted")
    data = base64.b64decode(item["v"], validate=True)
    return np.frombuffer(data, dtype=dtype).reshape(item["shape"]).copy()


def _decode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict) or not isinstance(value.get(TAG), str):
        raise LoaderStateError(f"untagged value of type {type(value).__name__}")
    kind = value[TAG]
    if kind == "tuple":
        return tuple(_decode(v) for v in value["v"])
    if kind == "bytes":
        return base64.b64decode(value["v"], validate=True)
    if kind == "tensor":
        return torch.from_numpy(_array(value))
    if kind == "ndarray":
        return _array(value)
    if kind == "npscalar":
        return _array(value)[()]
    if kind == "state":
        cls = _energon_class(value["class"])
        if not dataclasses.is_dataclass(cls):
            raise LoaderStateError(f"{value['class']} is not a state dataclass")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(value["v"]) != fields:
            raise LoaderStateError(f"{value['class']} fields differ: {sorted(value['v'])}")
        return cls(**{k: _decode(v) for k, v in value["v"].items()})
    cls = dict if kind == "dict" else _energon_class(kind)
    if not issubclass(cls, dict):
        raise LoaderStateError(f"{kind} is not a dict type")
    return cls((_decode(k), _decode(v)) for k, v in value["v"])


def from_plain(value: Any) -> Any:
    """Rebuild what ``to_plain`` wrote.

    Raises:
        LoaderStateError: anything ``to_plain`` does not write (one line).
    """
    importlib.import_module("megatron.energon")  # its state classes, looked up by name
    try:
        return _decode(value)
    except LoaderStateError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise LoaderStateError(f"malformed loader state ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''})") from None
