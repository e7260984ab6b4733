"""Distributed training against a float64 reference, step by step, with float32's rounding bounds.

``check_steps`` takes what every rank recorded (its parameter shards before each step and after the
last, its gradient shards of each step) and checks, for every step, every rank, every parameter and
every element:

- the parameters the step starts from are the ones the ranks of the first shard group hold
  together (replicas hold the same), and at step 0 the model's initial ones, exactly;
- each rank's gradient shard is the float64 gradient of the mean of the ranks' losses at those
  parameters, within ``float_error.gradient_bound``; where the run clipped its gradients
  (``Clipping``), each rank's total norm is ``torch.nn.utils.clip_grad_norm_``'s on the float64
  model within ``Clipping.norm_rtol``, and its gradient shard is the float64 gradient scaled by
  the coefficient that norm gives;
- each rank's optimizer step is the float64 replay of it on that rank's own gradient, within
  ``float_error.OptimizerReplay``'s bound on float32's rounding of one step.

Each step starts from the ranks' own parameters, so nothing carries the comparison's allowance from
one step to the next: AdamW, which turns a rounding in a tiny gradient into a change of up to its
learning rate, would otherwise let three steps of noise through as "agreement". Together the checks
say the run is a float32 rounding of the reference's steps. Every mismatch is gathered, then
``Mismatches.assert_none`` reports them all (the tensor, the rank, the element, both values and the
allowed error).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from thunder_overlap.testing.float_error import OptimizerReplay, gradient_bound

__all__ = [
    "Clipping",
    "Mismatch",
    "Mismatches",
    "RankSteps",
    "StepCheck",
    "assert_losses_close",
    "assert_states_equal",
    "check_gradient_shards",
    "check_steps",
    "one_step_reference",
    "real_rows",
    "reference_gradients",
]


@dataclass(frozen=True)
class Mismatch:
    what: str  # e.g. "step 2 parameter wte.weight"
    rank: int
    index: tuple[int, ...]
    actual: float
    expected: float
    allowed: float

    def __str__(self) -> str:
        return (
            f"{self.what} on rank {self.rank} at {list(self.index)}: {self.actual!r} against {self.expected!r} "
            f"(differs by {abs(self.actual - self.expected):.3g}, allowed {self.allowed:.3g})"
        )


@dataclass
class Mismatches:
    """Every element that differs by more than it is allowed, gathered across ranks and tensors."""

    found: list[Mismatch] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # e.g. different names or shapes
    compared: int = 0

    def compare(self, what: str, rank: int, actual: torch.Tensor, expected: torch.Tensor, allowed: torch.Tensor | float) -> None:
        if actual.shape != expected.shape:
            self.problems.append(f"{what} on rank {rank}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            return
        actual64, expected64 = actual.detach().double(), expected.detach().double()
        allowed64 = torch.as_tensor(allowed, dtype=torch.float64).expand_as(expected64)
        bad = ~((actual64 - expected64).abs() <= allowed64)  # NaN is bad too
        self.compared += expected64.numel()
        for index in bad.nonzero().tolist():
            at = tuple(index)
            self.found.append(Mismatch(what, rank, at, actual64[at].item(), expected64[at].item(), allowed64[at].item()))

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def about(self, prefix: str) -> Mismatches:
        """Those whose tensor's description starts with ``prefix`` (e.g. "step 1 gradient")."""
        found = [m for m in self.found if m.what.startswith(prefix)]
        return Mismatches(found, [p for p in self.problems if p.startswith(prefix)], self.compared)

    def assert_none(self, limit: int = 30) -> None:
        if not self.found and not self.problems:
            return
        lines = list(self.problems)
        if self.found:
            tensors = sorted({f"{m.what} on rank {m.rank}" for m in self.found})
            counts = f"{len(self.found)} of {self.compared} elements, in {len(tensors)} tensors,"
            lines.append(f"{counts} differ by more than float32 rounding allows:")
            lines += [f"  {m}" for m in self.found[:limit]]
            if len(self.found) > limit:
                lines.append(f"  ... and {len(self.found) - limit} more, in: {', '.join(tensors)}")
        raise AssertionError("\n".join(lines))


@dataclass
class RankSteps:
    """What one rank recorded: its parameter shards (dim-0 chunks, padded as Thunder pads) before each
    step and after the last, its gradient shards of each step (a frozen parameter has none), and
    where it clipped them, the total norm ``clip_grad_norm_`` returned at each step."""

    rank: int
    params: list[dict[str, torch.Tensor]]
    grads: list[dict[str, torch.Tensor]]
    grad_norms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Clipping:
    """Each step clipped the gradient: ``clip_grad_norm_(max_norm, norm_type)`` before the
    optimizer stepped."""

    max_norm: float
    norm_type: float = 2.0
    # How far (relative) a rank's total norm may be from one process's on the float64 model.
    # Its rounding is the gradient's carried into a sum of squares (float32's, some 1e-7 relative
    # on these models), far below this; a norm of one rank's shard alone, or of the padding, is
    # off by tens of percent.
    norm_rtol: float = 1e-5

    def coefficient(self, total_norm: float) -> float:
        """What torch.nn.utils.clip_grad_norm_ multiplies the gradients by, given the total norm."""
        return min(1.0, self.max_norm / (total_norm + 1e-6))


@dataclass
class StepCheck:
    mismatches: Mismatches
    # The float64 loss at each step's parameters (the mean of the ranks' losses).
    losses: list[float]

    def assert_mean_losses(self, per_rank: Sequence[Sequence[float]]) -> None:
        """The mean of the ranks' losses at each step against float64's at the same parameters."""
        assert_losses_close([sum(losses[step] for losses in per_rank) / len(per_rank) for step in range(len(self.losses))], self.losses)


def assert_losses_close(actual: Sequence[float], expected: Sequence[float]) -> None:
    """float32 losses against float64's at the same parameters. Cross-entropy is a mean of terms
    >= 0, so float32 rounds it by a few units of 6e-8 relative (measured: 1e-8 to 1.2e-7);
    rtol 1e-5 allows some 170 roundings, a hundred times more, and is still far below what a
    wrong batch or a skipped step changes (1e-3 and more)."""
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def assert_states_equal(actual: dict, expected: dict, **tolerance) -> None:
    """Two (nested) state dicts hold the same keys and close tensors (``torch.testing.assert_close``
    with ``tolerance``), each mismatch named by its key."""
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, dict):
            assert_states_equal(actual[name], value, **tolerance)
        else:
            torch.testing.assert_close(actual[name], value, msg=name, **tolerance)


def real_rows(numel_rows: int, shard_rank: int, shards: int) -> tuple[int, int]:
    """(first row, number of real rows) of ``shard_rank``'s dim-0 chunk of ``numel_rows`` rows, as
    Thunder shards: chunks of ceil(rows / shards), the last ones padded."""
    chunk = -(-numel_rows // shards)
    start = min(shard_rank * chunk, numel_rows)
    return start, min(chunk, numel_rows - start)


def _assemble(ranks: Sequence[RankSteps], step: int, shapes: dict[str, torch.Size], shards: int) -> dict[str, torch.Tensor]:
    """The full parameters the first shard group (ranks 0 .. shards - 1) holds before ``step``."""
    full = {}
    for name, shape in shapes.items():
        pieces = [ranks[k].params[step][name][: real_rows(shape[0], k, shards)[1]] for k in range(shards)]
        full[name] = torch.cat(pieces).double()
    return full


def reference_gradients(model: nn.Module, terms: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """name -> each term's gradient (trainable parameters only): ``terms`` are each rank's loss on
    ``model`` (float64), and the ranks' averaged gradient is the mean of these shares."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shares: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
    for term in terms:
        grads = torch.autograd.grad(term, [p for _, p in named], retain_graph=True, allow_unused=True)
        for (name, p), g in zip(named, grads, strict=True):
            shares[name].append(torch.zeros_like(p) if g is None else g)
    return shares


def check_steps(
    ranks: Sequence[RankSteps],
    initial: nn.Module,
    loss_terms: Callable[[nn.Module, int], list[torch.Tensor]],
    replay: Callable[[], OptimizerReplay],
    roundings: int,
    *,
    shards: int | None = None,
    clip: Clipping | None = None,
) -> StepCheck:
    """Checks every recorded step of ``ranks`` (see the module docstring).

    ``initial``: the model as built before sharding (its parameters are step 0's). ``loss_terms(model,
    step)``: each rank's loss at ``step`` on ``model`` (the float64 reference); the run descends
    their mean. ``replay()``: a fresh OptimizerReplay like the ranks' optimizer. ``roundings``:
    ``float_error.rounding_count`` of the computation. ``shards``: ranks per shard group (consecutive
    ranks; the default, all of them; fewer under hybrid sharding)."""
    shards = shards or len(ranks)
    mismatches = Mismatches()
    model = copy.deepcopy(initial).double()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for r in ranks:
        if set(r.params[0]) != set(shapes):
            mismatches.problem(f"rank {r.rank} holds parameters {sorted(r.params[0])}, the model has {sorted(shapes)}")
    if mismatches.problems:
        return StepCheck(mismatches, [])
    initial_params = {name: p.detach().double() for name, p in model.named_parameters()}
    replays = [replay() for _ in ranks]
    losses = []
    for step in range(len(ranks[0].grads)):
        full = initial_params if step == 0 else _assemble(ranks, step, shapes, shards)
        _check_held(mismatches, ranks, step, full, shards)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(full[name])
        terms = loss_terms(model, step)
        losses.append(torch.stack([t.detach() for t in terms]).mean().item())
        shares = reference_gradients(model, terms)
        for r in ranks:
            rank_shares, rank_roundings = shares, roundings
            if clip is not None:
                rank_shares = _clipped_shares(mismatches, model, r, step, shares, clip)
                # The coefficient's division and the scaling round the gradient three times more.
                rank_roundings = roundings + 3
            _check_gradients(mismatches, r, step, rank_shares, shards, rank_roundings)
            _check_update(mismatches, r, step, replays[r.rank], shapes, shards)
    return StepCheck(mismatches, losses)


def _clipped_shares(
    mismatches: Mismatches, model: nn.Module, r: RankSteps, step: int, shares: dict[str, list[torch.Tensor]], clip: Clipping
) -> dict[str, list[torch.Tensor]]:
    """Compares the rank's total norm with ``torch.nn.utils.clip_grad_norm_`` on the float64
    ``model`` holding the averaged gradient; returns ``shares`` scaled by the coefficient the rank's
    own norm gives, so that its gradient is checked against what it should have scaled by."""
    if len(r.grad_norms) <= step:
        mismatches.problem(f"step {step + 1} total gradient norm on rank {r.rank}: not recorded, but the run clipped")
        return shares
    for name, p in model.named_parameters():
        p.grad = torch.stack(shares[name]).mean(0) if name in shares else None
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), clip.max_norm, clip.norm_type)
    model.zero_grad(set_to_none=True)
    actual = torch.tensor(r.grad_norms[step], dtype=torch.float64)
    mismatches.compare(f"step {step + 1} total gradient norm", r.rank, actual, expected, clip.norm_rtol * expected)
    coefficient = clip.coefficient(r.grad_norms[step])
    return {name: [share * coefficient for share in terms] for name, terms in shares.items()}


def _check_held(mismatches: Mismatches, ranks: Sequence[RankSteps], step: int, full: dict[str, torch.Tensor], shards: int) -> None:
    for r in ranks:
        for name, value in full.items():
            start, rows = real_rows(value.shape[0], r.rank % shards, shards)
            held = r.params[step][name][:rows]
            mismatches.compare(f"step {step + 1} starting parameter {name}", r.rank, held, value[start : start + rows], 0.0)


def _check_gradients(
    mismatches: Mismatches, r: RankSteps, step: int, shares: dict[str, list[torch.Tensor]], shards: int, roundings: int
) -> None:
    check_gradient_shards(mismatches, f"step {step + 1} gradient", r.rank, r.grads[step], shares, (r.rank % shards, shards), roundings)


def check_gradient_shards(
    mismatches: Mismatches,
    what: str,
    rank: int,
    grads: dict[str, torch.Tensor],
    shares: dict[str, list[torch.Tensor]],
    placement: tuple[int, int],
    roundings: int,
) -> None:
    """Compares a rank's gradient shards (name -> padded dim-0 chunk) with the mean of ``shares``
    (``reference_gradients``), within ``float_error.gradient_bound``. ``placement``: (the rank's
    place in its shard group, the group's size)."""
    if set(grads) != set(shares):
        mismatches.problem(f"{what} on rank {rank}: gradients for {sorted(grads)}, trainable {sorted(shares)}")
    for name, terms in shares.items():
        if name not in grads:
            continue
        expected = torch.stack(terms).mean(0)
        start, rows = real_rows(expected.shape[0], *placement)
        allowed = gradient_bound(terms, roundings)
        mismatches.compare(f"{what} {name}", rank, grads[name][:rows], expected[start : start + rows], allowed)


def _check_update(mismatches: Mismatches, r: RankSteps, step: int, replay: OptimizerReplay, shapes: dict, shards: int) -> None:
    for name, (expected, allowed) in replay.step(r.params[step], r.grads[step]).items():
        # Real rows only: a padding row is no parameter (Thunder leaves it uninitialised).
        _, rows = real_rows(shapes[name][0], r.rank % shards, shards)
        after = r.params[step + 1][name][:rows]
        mismatches.compare(f"step {step + 1} parameter {name} after the optimizer", r.rank, after, expected[:rows], allowed[:rows])


def one_step_reference(
    model: nn.Module, terms: list[torch.Tensor], state: dict[str, dict], replay: OptimizerReplay, roundings: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One optimizer step resumed from ``state`` (torch's per-parameter state by name, e.g. a
    checkpoint's) at ``model``'s parameters (float64), ``terms`` being each rank's loss on it, as a
    float32 run resumed from the same state would take it with its own rounding of the gradient:
    name -> (the exact step's result, how far a float32 run may land from it). The allowance is the
    gradient's rounding bound carried through the step (``OptimizerReplay.spread``: AdamW may
    amplify it up to its learning rate where a gradient is tiny) plus the step's own rounding."""
    shares = reference_gradients(model, terms)
    params = {name: p.detach() for name, p in model.named_parameters()}
    grads = {name: torch.stack(s).mean(0) for name, s in shares.items()}
    before = {name: {k: torch.as_tensor(v).double() for k, v in state[name].items()} for name in grads if name in state}
    replay.set_state(params, state)
    result = {}
    for name, (value, allowed) in replay.step(params, grads).items():
        if name in grads:
            allowed = allowed + replay.spread(gradient_bound(shares[name], roundings), grads[name], before.get(name))
        result[name] = (value, allowed)
    return result
