"""Small hand-written and random traces for scheduler tests: square matmuls, elementwise adds,
all-gathers of parameter shards and reduce-scatters of computed tensors, on a fake process group.

A program is a list of steps, each reading earlier values by position:
- ``("gather", )``: a new parameter shard input, all-gathered (issue + wait, written just in time);
- ``("matmul", i, j)`` and ``("add", i, j)``: compute on values ``i`` and ``j``;
- ``("scatter", i)``: reduce-scatter value ``i`` (issue + wait right away); its shard is returned.
Every value is ``SIZE x SIZE`` float32, so any two combine.
"""

from __future__ import annotations

import thunder
import thunder.torch as ltorch
import torch
import torch.distributed as dist
from thunder.distributed import prims as dist_prims
from thunder.distributed.prims import DistributedReduceOps

SIZE = 8
VALUE_BYTES = SIZE * SIZE * 4


def build_trace(program: list[tuple], group: dist.ProcessGroup):
    """The Thunder trace of ``program`` (collectives as asynchronous prims) and its parameter
    shards' count."""
    shards = sum(1 for step in program if step[0] == "gather")

    def fn(x, *params):
        values = [x]
        next_param = iter(params)
        outputs = []
        for step in program:
            kind = step[0]
            if kind == "gather":
                values.append(dist_prims.wait(dist_prims.all_gather(next(next_param), group, True, 0)))
            elif kind == "matmul":
                values.append(ltorch.matmul(values[step[1]], values[step[2]]))
            elif kind == "add":
                values.append(ltorch.add(values[step[1]], values[step[2]]))
            elif kind == "scatter":
                scattered = dist_prims.reduce_scatter(values[step[1]], DistributedReduceOps.SUM, group, True, 0)
                outputs.append(dist_prims.wait(scattered))
            else:
                raise ValueError(f"unknown step {step!r}")
        return values[-1], *outputs

    x = torch.randn(SIZE, SIZE)
    params = [torch.randn(SIZE // group.size(), SIZE) for _ in range(shards)]
    return thunder.trace()(fn, x, *params)


def valid_program(choices: list[tuple[str, int, int]]) -> list[tuple]:
    """Turns arbitrary (kind, a, b) draws into a program whose references point backwards."""
    program: list[tuple] = []
    values = 1
    for kind, a, b in choices:
        if kind == "scatter":
            program.append(("scatter", a % values))
            continue
        if kind == "gather":
            program.append(("gather",))
        else:
            program.append((kind, a % values, b % values))
        values += 1
    return program
