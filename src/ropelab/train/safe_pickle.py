"""Loading a checkpoint runs no code from it: tensors and plain data only.

A pickle can call any importable function while it is read (``__reduce__`` returning
``(os.system, ("...",))``), so nothing of a checkpoint is unpickled by plain `pickle`:
  * ``state.pt`` and ``rng_rank<R>.pt``: ``torch.load(weights_only=True)`` (tensors, dicts, lists,
    tuples, numbers, strings). `load_plain` turns its refusals into one line naming the file.
    rng files written before numpy's and python's RNG states were stored as tensors and lists hold
    numpy arrays: for those files only, `load_plain(legacy_numpy=True)` also admits numpy's
    array-rebuilding functions (plain numeric arrays, no code);
  * ``dcp/.metadata``: `SafeFileSystemReader` (a `FileSystemReader` for
    ``dcp.load(storage_reader=...)``) reads it with `MetadataUnpickler`, which admits only
    torch.distributed.checkpoint's own metadata classes, ``torch.Size``, torch dtypes / layouts /
    memory formats and ``pathlib`` paths; PyTorch's own reader uses ``pickle.load``;
  * the non-tensor entries of the dcp shards (optimizer hyperparameters): `SafeLoadPlanner`, a
    `DefaultLoadPlanner` whose `load_bytes` reads them with ``weights_only=True`` (the default one
    does not);
  * ``model.safetensors``: safetensors, which holds no code by design.
A refused file raises `UnsafeCheckpoint` (a ConfigError: one line naming the file and what it asked for).
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import io
import pathlib
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ropelab.config import ConfigError
from ropelab.errors import one_line
from ropelab.train.integrity import DamagedCheckpoint

_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file holds something other than tensors and plain data (it would run code)."""


def _refusal(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused, in a few words (its message is a page long)."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it would import {found[1]}"
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    return found[1].strip()[:160] if found else "it asks for more than tensors and plain data"


def _legacy_numpy_globals() -> list:
    import numpy as np

    rebuild = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    plain = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):  # no (object, name) pairs yet
        return [rebuild, *plain]
    names = ["numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"]  # numpy 1 / 2 files
    return [*((rebuild, name) for name in names), *plain]


def load_plain(path: Path, legacy_numpy: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a refusal raises UnsafeCheckpoint, a file
    no parser can read DamagedCheckpoint (both one line naming the file)."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise DamagedCheckpoint(path.parent, path.name, f"unreadable ({one_line(exc)})") from None
        refusal = exc
    except Exception as exc:  # truncated zip, bad magic number, ... (caught by the checksum when there is one)
        raise DamagedCheckpoint(path.parent, path.name, f"unreadable ({one_line(exc)})") from None
    if legacy_numpy and "numpy" in str(refusal):
        try:
            with torch.serialization.safe_globals(_legacy_numpy_globals()):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            refusal = exc
        except Exception as exc:
            raise DamagedCheckpoint(path.parent, path.name, f"unreadable ({one_line(exc)})") from None
    raise UnsafeCheckpoint(f"{path}: refusing to load it: {_refusal(refusal)} "
                           "(a checkpoint file holds tensors and plain data only)") from None


# --------------------------------------------------------------------------- dcp/.metadata


@functools.cache
def _metadata_classes() -> dict[tuple[str, str], Any]:
    """What a dcp .metadata pickle may name: dcp's metadata dataclasses and enums, `_StorageInfo`,
    torch.Size, the layout lookup, pathlib paths (the checkpoint id) and sets."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {}
    for name, obj in vars(metadata).items():
        if isinstance(obj, type) and obj.__module__ == metadata.__name__ and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            allowed[(metadata.__name__, name)] = obj
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    for name in ("set", "frozenset"):
        allowed[("builtins", name)] = getattr(builtins, name)
    return allowed


_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """A pickle reader that builds torch.distributed.checkpoint metadata and nothing else: it can
    import only `_metadata_classes` and torch's dtype / layout / memory-format constants."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _metadata_classes()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it would import {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference")


def load_dcp_metadata(path: Path):
    """A ``dcp/.metadata`` file as a `Metadata` object, built by `MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    where = (path.parent.parent, f"{path.parent.name}/{path.name}")
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DamagedCheckpoint(*where, "missing") from None
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("it "):
            raise UnsafeCheckpoint(f"{path}: refusing to load it: {exc} (dcp metadata holds checkpoint "
                                   "metadata only)") from None
        raise DamagedCheckpoint(*where, f"unreadable ({one_line(exc)})") from None
    except Exception as exc:  # truncated or garbled pickle
        raise DamagedCheckpoint(*where, f"unreadable ({one_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path}: refusing to load it: a {type(metadata).__name__}, not dcp Metadata")
    return metadata


@functools.cache
def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """A FileSystemReader whose ``.metadata`` is read by `MetadataUnpickler` instead of pickle.load
        (pass it to ``dcp.load(state, storage_reader=SafeFileSystemReader(folder))``)."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            if hasattr(self, "_get_metadata_path"):
                path = self._get_metadata_path(kwargs.get("rank"))
            else:  # older torch: always the coordinator's file
                path = Path(self.path) / ".metadata"
            metadata = load_dcp_metadata(Path(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            if hasattr(self, "load_id"):
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


@functools.cache
def _planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """A DefaultLoadPlanner whose non-tensor entries are read with weights_only=True
        (`SafeLoadPlanner(shard_folder)`; the folder only names the file in a refusal)."""

        def __init__(self, shard_folder: Path = Path("dcp"), *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.shard_folder = Path(shard_folder)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpoint(f"{self.shard_folder}: refusing to load its entry {fqn}: {_refusal(exc)} "
                                       "(a checkpoint holds tensors and plain data only)") from None
            plain = io.BytesIO()
            torch.save(obj, plain)  # plain data written afresh: the parent's weights_only=False load of it is harmless
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return SafeLoadPlanner


def __getattr__(name: str):
    """`SafeFileSystemReader` and `SafeLoadPlanner`, built on first use (torch.distributed.checkpoint
    takes a second to import)."""
    if name == "SafeFileSystemReader":
        return _reader_class()
    if name == "SafeLoadPlanner":
        return _planner_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _first_failure(exc: BaseException) -> BaseException:
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        if isinstance(inner, BaseException):
            return inner
    return exc


def dcp_load(state: dict, folder: Path) -> None:
    """``dcp.load(state)`` from a dcp folder, through the safe reader and planner; its errors as one
    line (ConfigError)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    load_dcp_metadata(folder / ".metadata")  # refuse, or report damage, before dcp starts a collective
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            dcp.load(state, storage_reader=_reader_class()(str(folder)), planner=_planner_class()(folder))
    except CheckpointException as exc:
        inner = _first_failure(exc)
        if isinstance(inner, ConfigError):
            raise inner from None
        raise ConfigError(f"{folder}: cannot load it ({one_line(inner)})") from None
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{folder}: cannot load it ({one_line(exc)})") from None


def read_dcp_metadata(folder: Path):
    """The `Metadata` of a dcp folder (tensor names and sizes), read safely."""
    return load_dcp_metadata(Path(folder) / ".metadata")


__all__ = ["UnsafeCheckpoint", "load_plain", "load_dcp_metadata", "read_dcp_metadata", "dcp_load",
           "SafeFileSystemReader", "SafeLoadPlanner", "MetadataUnpickler"]
