"""Collectives: what the ranks of one run say to each other, behind one object.

A worker that trains alone (a single-process run, an average/DiLoCo round worker) gets :class:`Single`, whose
collectives return their input; the ranks of a DDP run get :class:`Group` over the torch.distributed process group
(gloo on the CPU; NCCL plugs in through the device's backend). The training core calls these and never asks how many
ranks there are, so no code path forks on ``world > 1``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Single:
    """One process: every collective is the identity."""

    rank, world = 0, 1
    sharded = False  # the model is sharded over the ranks (train.parallel shard: train/shard.py)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (one value each), concatenated in rank order."""
        return t

    def gather_tensors(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D ``t`` (lengths may differ), in rank order."""
        return [t]

    def barrier(self) -> None:
        pass

    def wrap(self, model: torch.nn.Module, device) -> torch.nn.Module:
        """The network the steps run: the model itself."""
        return model

    def no_sync(self, net: torch.nn.Module, last: bool):
        """Around a micro-batch's backward: nothing to hold back alone."""
        return nullcontext()


class Group(Single):
    """The ranks of a torch.distributed process group (already initialised by the rank's process)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def sum(self, t):
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def max(self, t):
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def mean(self, t):
        return self.sum(t).div_(self.world)

    def gather(self, t):
        import torch
        import torch.distributed as dist

        parts = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    def gather_tensors(self, t):
        """Tensors only, never all_gather_object: a peer's bytes are never unpickled (a pickle runs code)."""
        import torch
        import torch.distributed as dist

        # NCCL gathers on the GPU; a CPU tensor (the RNG state) goes there and back
        wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
        flat = t.reshape(-1).to(wire)
        sizes = self.gather(torch.tensor([flat.numel()], device=wire)).tolist()
        padded = torch.zeros(max(sizes), dtype=flat.dtype, device=wire)
        padded[:flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return [p[:n].to(t.device, copy=True) for p, n in zip(parts, sizes)]  # each its own storage

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def wrap(self, model, device):
        """DistributedDataParallel over the group, as the device places it."""
        return device.data_parallel(model)

    def no_sync(self, net, last: bool):
        """Gradients are all-reduced once per optimizer step: at the last micro-batch's backward."""
        return nullcontext() if last or not hasattr(net, "no_sync") else net.no_sync()


class Sharded(Group):
    """The ranks of a sharded run (FSDP2, train/shard.py): the model is sharded when it is built, so the network is the
    model itself; its gradients are reduce-scattered at every micro-batch's backward (accumulating them unsharded
    until the last would hold a whole model's gradients on every rank, the memory sharding saves)."""

    sharded = True

    def wrap(self, model, device):
        return model

    def no_sync(self, net, last: bool):
        return nullcontext()


def of(rank: int, world: int, *, shard: bool = False) -> Single:
    """The collectives of rank ``rank`` of ``world`` (its process group initialised when ``world > 1``, or when
    ``shard``: a sharded run keeps its form, and its checkpoints theirs, on one rank too)."""
    if shard:
        return Sharded(rank, world)
    return Group(rank, world) if world > 1 else Single()
