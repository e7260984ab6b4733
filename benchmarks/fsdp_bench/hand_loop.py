"""A hand-written ZeRO2 prefetch loop in plain PyTorch: the strongest overlap baseline on CPU.

What a practitioner would write with no FSDP library: one flat buffer per unit (each block, and
one for every parameter outside the blocks), gathered with ``all_gather_into_tensor(async_op=True)``
one unit ahead of the compute (a forward pre-hook on each block waits for its own gather and
issues the next), and each unit's gradient reduce-scattered asynchronously as soon as the last of
its parameters has accumulated its gradient (a post-accumulate-grad hook), all waited for at the
end of the backward. Compute is eager PyTorch on the unsharded parameters; the optimizer steps
each rank's flat shards. ZeRO2 only: the unsharded buffers stay allocated (and gathered) from the
forward through the backward; they are allocated once and reused every step.

It moves the same bytes as thunder_overlap's ZeRO2 with block buckets, so their step times side
by side say what thunder_overlap's scheduling and dispatch cost or save against a loop written
for this one model (the issue's slow-link target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from thunder_overlap._analysis.blocks import find_blocks

__all__ = ["HandPrefetchZero2"]


@dataclass
class _Unit:
    """One unit's parameters, laid out back to back in ``unsharded`` (padded to a multiple of the
    world size); ``shard`` is this rank's slice, the parameter the optimizer steps."""

    params: list[nn.Parameter]
    unsharded: torch.Tensor
    shard: nn.Parameter
    gather: dist.Work | None = None
    grads_left: int = 0
    # The launched reduce-scatter, its output, and its input (kept alive until the wait).
    reduction: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None

    def issue_gather(self) -> None:
        self.gather = dist.all_gather_into_tensor(self.unsharded, self.shard.detach(), async_op=True)

    def wait_gather(self) -> None:
        if self.gather is not None:
            self.gather.wait()
            self.gather = None


def _make_unit(params: list[nn.Parameter], rank: int, world_size: int) -> _Unit:
    numel = sum(p.numel() for p in params)
    shard_numel = -(-numel // world_size)
    unsharded = torch.zeros(shard_numel * world_size, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for p in params:
            unsharded[offset : offset + p.numel()].copy_(p.reshape(-1))
            # The parameter becomes a view of the unit's buffer: a gather updates it in place.
            p.data = unsharded[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
    shard = nn.Parameter(unsharded[rank * shard_numel : (rank + 1) * shard_numel].clone())
    return _Unit(params, unsharded, shard)


class HandPrefetchZero2(nn.Module):
    """``model`` trained as a hand-written ZeRO2 loop; its ``parameters()`` are the flat shards."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        blocks = [block for _, block in find_blocks(model)]
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no repeated blocks (nn.ModuleList) to gather one ahead")
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_blocks]
        groups = [rest] + [[p for p in block.parameters() if p.requires_grad] for block in blocks]
        self._units = [_make_unit(params, self._rank, self._world_size) for params in groups if params]
        # Whether this backward's end-of-backward wait is queued yet.
        self._callback_queued = False
        self.shards = nn.ParameterList(unit.shard for unit in self._units)
        for i, unit in enumerate(self._units):
            self.register_buffer(f"unsharded_{i}", unit.unsharded, persistent=False)
        # The wrapped model is not a submodule: its parameters are views of the buffers above.
        self._model = [model]
        first_block = len(self._units) - len(blocks)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda _module, _args, unit=first_block + i: self._before_unit(unit))
        for unit in self._units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda _p, unit=unit: self._grad_ready(unit))

    def _before_unit(self, index: int) -> None:
        units = self._units
        units[index].wait_gather()
        if index + 1 < len(units):
            units[index + 1].issue_gather()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        units = self._units
        for unit in units:
            unit.grads_left = len(unit.params)
        self._callback_queued = False
        # The parameters outside the blocks (embeddings first) and the first block go out together.
        units[0].issue_gather()
        if len(units) > 1:
            units[1].issue_gather()
        units[0].wait_gather()
        return self._model[0](idx)

    def _grad_ready(self, unit: _Unit) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        unit.grads_left -= 1
        if unit.grads_left:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in unit.params])
        flat = nn.functional.pad(flat, (0, unit.unsharded.numel() - flat.numel())).div_(self._world_size)
        for p in unit.params:
            p.grad = None
        shard_grad = torch.empty_like(unit.shard)
        unit.reduction = (dist.reduce_scatter_tensor(shard_grad, flat, async_op=True), shard_grad, flat)

    def _finish_backward(self) -> None:
        for unit in self._units:
            if unit.reduction is None:
                continue
            work, shard_grad, _ = unit.reduction
            work.wait()
            unit.shard.grad = shard_grad
            unit.reduction = None
