"""Routing traces: which experts the router chose for every token (DESIGN.md 5).

A trace is what `mira trace` records while generating and what `mira simulate` replays through
every cache policy (paper IV-D's rebalancer and the baselines), so that a trace from any source
can be compared against Belady's bound. It is also the training signal of the predictor heads
(paper IV-E). On disk it is one `.npz`:

    topk_ids      int16   [T, L, K]   routed expert ids: T tokens in order, L MoE layers, top-K
    num_experts   int     scalar      experts per MoE layer (E)
    topk_weights  float16 [T, L, K]   optional: the router weights of those ids
    seq_id        int32   [T]         optional: which sequence each token belongs to
    is_prefill    bool    [T]         optional: whether the token was part of a prompt

Other arrays in the file (predictor features, for instance) are ignored.
An expert is the pair (layer, id); its uid is `layer * num_experts + id`.
"""

from __future__ import annotations

import os
from pathlib import Path
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mira.errors import MiraError
from mira.store.files import write_npz_atomic

_OPTIONAL = {"topk_weights": np.float16, "seq_id": np.int32, "is_prefill": np.bool_}
_MAX_EXPERTS = int(np.iinfo(np.int16).max) + 1  # ids must fit int16


class TraceError(MiraError, ValueError):
    """A trace file or array that does not follow DESIGN.md 5; the message names the problem."""


class Group(NamedTuple):
    """The accesses of one (token, layer): each distinct routed expert once, in ascending id.

    experts: (uid, tokens) pairs; tokens is how often the expert appears in the token's top-K
        (1 unless the router repeated an id).
    """

    token: int
    layer: int
    experts: tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """A routing trace held in memory; validated when built.

    Raises:
        TraceError: a dtype, shape or id range does not match DESIGN.md 5 (the message names it).
    """

    topk_ids: np.ndarray  # int16 [T, L, K]
    num_experts: int
    topk_weights: np.ndarray | None = None  # float16 [T, L, K]
    seq_id: np.ndarray | None = None  # int32 [T]
    is_prefill: np.ndarray | None = None  # bool [T]
    source: str = "<memory>"  # where it came from, for error messages

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[2]

    @property
    def num_uids(self) -> int:
        """Experts over all MoE layers (L * E), the size of the uid space."""
        return self.num_layers * self.num_experts

    def check_profile_of(self, num_layers: int, num_experts: int, model: str) -> None:
        """This trace as a profile (routed-token counts per expert) of a model of `num_layers` MoE
        layers of `num_experts` experts, `model` naming it in the message.

        Raises:
            TraceError: the layers or the experts per layer differ (the same total is not enough).
        """
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise TraceError(f"the profile {self.source} routes over {self.num_layers} layers x {self.num_experts} "
                             f"experts but {model} has {num_layers} x {num_experts}; record the profile with "
                             "`mira trace` on the same model")

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace to `path` atomically (a temporary file in the same folder, then renamed).

        Args:
            path: the `.npz` file to write; an existing file is replaced only once the new one is
                complete.
        """
        path = os.fspath(path)
        arrays = {"topk_ids": self.topk_ids, "num_experts": np.int64(self.num_experts)}
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                arrays[name] = value
        write_npz_atomic(Path(os.path.abspath(path)), arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        """Read and validate a trace written by `save` (or by any tool following DESIGN.md 5).

        Args:
            path: an `.npz` file.

        Returns:
            The trace.

        Raises:
            FileNotFoundError: no such file.
            TraceError: not an `.npz`, a required array missing, or a wrong dtype, shape or id range.
        """
        source = os.fspath(path)
        arrays = _read_npz(source)
        for name in ("topk_ids", "num_experts"):
            if name not in arrays:
                raise TraceError(f"trace {source}: missing array {name!r}, which every trace holds (topk_ids int16 "
                                 "[tokens, layers, top-k] and num_experts); record one with `mira trace`")
        num_experts = arrays["num_experts"]
        if num_experts.shape != () or num_experts.dtype.kind not in "iu":
            raise TraceError(
                f"trace {source}: num_experts must be one integer, got {num_experts.dtype} of shape {num_experts.shape}"
            )
        return cls(
            topk_ids=arrays["topk_ids"],
            num_experts=int(num_experts),
            source=source,
            **{name: arrays.get(name) for name in _OPTIONAL},
        )

    def accesses(self) -> Iterator[Group]:
        """The replay order of DESIGN.md 5: token by token, layer by layer, ascending expert id.

        Returns:
            An iterator over one `Group` per (token, layer), each distinct routed expert once with
            its token count.
        """
        uids = self._sorted_uids()  # [T, L, K]
        for token, per_layer in enumerate(uids.tolist()):
            for layer, row in enumerate(per_layer):
                yield Group(token, layer, _count_sorted(row))

    def uid_sequence(self) -> np.ndarray:
        """The uids of all accesses in replay order, one per distinct (token, layer, expert).

        Returns:
            int64 [N] with N = the number of accesses `accesses()` yields.
        """
        uids = self._sorted_uids()  # [T, L, K]
        first = np.ones(uids.shape, dtype=bool)  # [T, L, K]: not a repeat of the previous id
        first[..., 1:] = uids[..., 1:] != uids[..., :-1]
        return uids[first]  # [N], C order = replay order

    def tokens(self, start: int, stop: int) -> RoutingTrace:
        """The trace of tokens [start, stop) alone (a calibration part, or the part after it)."""
        def part(array: np.ndarray | None) -> np.ndarray | None:
            return None if array is None else array[start:stop]

        return RoutingTrace(self.topk_ids[start:stop], self.num_experts, part(self.topk_weights), part(self.seq_id),
                            part(self.is_prefill), f"{self.source}[{start}:{stop}]")

    def expert_counts(self) -> np.ndarray:
        """Routed tokens per expert over the whole trace (a profile for the static policy).

        Returns:
            int64 [L * E], indexed by uid.
        """
        return np.bincount(self._sorted_uids().ravel(), minlength=self.num_uids)

    def _sorted_uids(self) -> np.ndarray:
        """int64 [T, L, K]: uids, ascending within each (token, layer)."""
        ids = np.sort(self.topk_ids.astype(np.int64), axis=-1)  # [T, L, K]
        return ids + (np.arange(self.num_layers) * self.num_experts)[None, :, None]


def _read_npz(source: str) -> dict[str, np.ndarray]:
    """All arrays of an `.npz`, or a TraceError saying why the file is not one."""
    try:
        with open(source, "rb") as file:
            magic = file.read(6)
    except (IsADirectoryError, PermissionError) as error:  # a missing file raises FileNotFoundError
        raise TraceError(f"trace {source}: cannot read it ({error.strerror}); pass an .npz file") from None
    if not magic.startswith(b"PK") and magic != b"\x93NUMPY":  # numpy would try it as a pickle
        raise TraceError(f"trace {source}: not a readable .npz file (neither a zip archive nor an .npy array); "
                         "record traces with `mira trace`")
    try:
        data = np.load(source, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError) as error:
        raise TraceError(f"trace {source}: not a readable .npz file ({error})") from error
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise TraceError(f"trace {source}: a single .npy array, not an .npz archive of named arrays")
    with data:
        try:
            return {name: data[name] for name in data.files}
        except (zipfile.BadZipFile, ValueError, OSError) as error:
            raise TraceError(f"trace {source}: a damaged .npz file ({error})") from error


def _count_sorted(row: list[int]) -> tuple[tuple[int, int], ...]:
    """Run-length encode a sorted list into (value, count) pairs."""
    pairs: list[tuple[int, int]] = []
    for value in row:
        if pairs and pairs[-1][0] == value:
            pairs[-1] = (value, pairs[-1][1] + 1)
        else:
            pairs.append((value, 1))
    return tuple(pairs)


def _validate(trace: RoutingTrace) -> None:
    where = f"trace {trace.source}"
    ids = trace.topk_ids
    if not isinstance(ids, np.ndarray):
        raise TraceError(f"{where}: topk_ids must be a numpy array, got {type(ids).__name__}")
    if ids.dtype != np.int16:
        raise TraceError(f"{where}: topk_ids must be int16, got {ids.dtype}; convert it with .astype(np.int16)")
    if ids.ndim != 3:
        raise TraceError(f"{where}: topk_ids must have shape [tokens, layers, top_k], got shape {ids.shape}")
    if min(ids.shape) == 0:
        raise TraceError(f"{where}: topk_ids has an empty dimension (shape {ids.shape}); record at least one token")
    if not 1 <= trace.num_experts <= _MAX_EXPERTS:
        raise TraceError(f"{where}: num_experts must be between 1 and {_MAX_EXPERTS}, got {trace.num_experts}")
    if ids.min() < 0:
        raise TraceError(f"{where}: topk_ids has negative ids (down to {ids.min()})")
    if ids.max() >= trace.num_experts:
        raise TraceError(f"{where}: topk_ids has ids up to {ids.max()} but num_experts is {trace.num_experts}")
    for name, dtype in _OPTIONAL.items():
        value = getattr(trace, name)
        if value is None:
            continue
        shape = ids.shape if name == "topk_weights" else ids.shape[:1]
        if not isinstance(value, np.ndarray) or value.dtype != dtype:
            got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise TraceError(f"{where}: {name} must be {np.dtype(dtype)}, got {got}")
        if value.shape != shape:
            raise TraceError(f"{where}: {name} must have shape {shape} to match topk_ids, got {value.shape}")
