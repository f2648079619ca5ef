"""Every collective of dart-train, on the device its process group's backend needs.

NCCL reduces, gathers and broadcasts CUDA tensors only; gloo takes CPU tensors. A figure summed over the
ranks (losses, token counts, a status flag) is naturally a CPU number, and a CPU tensor handed to NCCL
fails the collective on every rank: so each tensor collective here moves its tensor to the group's device
when it is not there (CUDA's current device under NCCL, the CPU otherwise) and hands the result back where
the caller had it. Object collectives (pickled) are left to torch, which stages them on the current CUDA
device under NCCL itself.

The process group is joined here too (:func:`init_process_group`), with one timeout for every collective of
every backend (``train.backend.collective_timeout_s``): a collective that waits longer than that fails on
every rank instead of hanging. Nothing waits in a collective while idle: the ranks other than 0 wait for
rank 0's next command on the rendezvous store (:func:`command_store`, see :mod:`dart.train.distributed`).

The callers skip a collective where the group has one rank. ``DART_STRICT_COLLECTIVES=1`` turns those
shortcuts off (:func:`needed`), so a run on one GPU with one rank goes through NCCL's rules on every path
(the one-GPU check sets it). Nothing else in dart-train calls a ``torch.distributed`` collective (a
repository rule checks it).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

STRICT_ENV = "DART_STRICT_COLLECTIVES"
"""Set to 1 to run every collective even in a group of one rank (where a process group exists)."""


def init_process_group(device_type: str, timeout_s: float) -> tuple[int, int, int]:
    """Join torchrun's process group (NCCL for ``cuda``, else gloo) with ``timeout_s`` for every collective, or
    make a one-rank group when not launched by torchrun (an in-process store: nothing listens on the network).
    Returns ``(rank, world_size, local_rank)``; a group already joined is kept as it is."""
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]  # exported, but not in torch's __all__
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))


def command_store() -> Any:
    """The default process group's key-value store (torchrun's rendezvous store under a prefix of this group):
    rank 0 leaves commands there, the others wait on it without holding a collective open."""
    return dist.distributed_c10d._get_default_store()


def strict() -> bool:
    """Whether collectives run in groups of one rank too (``DART_STRICT_COLLECTIVES=1``)."""
    return os.environ.get(STRICT_ENV) == "1"


def needed(size: int) -> bool:
    """Whether a collective over a group of ``size`` ranks must run: always with more than one rank; with one,
    only in strict mode and where a process group exists."""
    return size > 1 or (strict() and dist.is_available() and dist.is_initialized())


def group_device(group: Any = None) -> torch.device:
    """The device the group's backend reduces on: this rank's current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, *, op: Any = None, group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (sum by default); it may live on any device."""
    device = group_device(group)
    kwargs = {"group": group} if op is None else {"group": group, "op": op}
    if tensor.device == device:
        dist.all_reduce(tensor, **kwargs)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, **kwargs)
    tensor.copy_(moved)
    return tensor


def sum_values(values: list[float], *, size: int, group: Any = None) -> list[float]:
    """Element-wise sums of ``values`` over the ranks of ``group`` (``size`` of them), in float64."""
    if not needed(size):
        return values
    summed = all_reduce(torch.tensor(values, dtype=torch.float64), group=group)
    return [float(v) for v in summed]


def min_int(value: int, *, group: Any = None) -> int:
    """The least of every rank's ``value`` (a status flag: 1 ok, 0 failed)."""
    flag = torch.tensor([value], dtype=torch.int32)
    return int(all_reduce(flag, op=dist.ReduceOp.MIN, group=group).item())


def all_gather(tensor: torch.Tensor, *, size: int, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on each), in rank order, on ``tensor``'s device."""
    device = group_device(group)
    local = tensor.contiguous().to(device)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return parts if device == tensor.device else [p.to(tensor.device) for p in parts]


def gather_objects(obj: Any, *, size: int, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` where the group has one rank, outside strict mode)."""
    if not needed(size):
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_tensors(tensors: dict[str, torch.Tensor], *, size: int) -> dict[str, torch.Tensor]:
    """Global rank 0's ``tensors`` on every rank, on the CPU (the other ranks pass ``{}``): names, shapes and
    dtypes first, then one tensor at a time (so no rank holds more than the dict and one tensor in flight)."""
    if not needed(size):
        return {k: v.cpu() for k, v in tensors.items()}
    main = dist.get_rank() == 0
    meta: list[Any] = [[(k, tuple(v.shape), v.dtype) for k, v in tensors.items()] if main else None]
    dist.broadcast_object_list(meta, src=0)
    device = group_device()
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in meta[0]:
        tensor = tensors[name].contiguous().to(device) if main else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        out[name] = tensor.cpu()
    return out


def barrier(*, size: int, group: Any = None) -> None:
    """Wait until every rank of ``group`` gets here."""
    if needed(size):
        dist.barrier(group=group)
