"""Real ZeRO3: save sharded parameters for backward and re-gather them there.

Thunder 0.2.6 runs ZERO3 like ZERO2: the forward returns unsharded parameters (and views of them,
such as an unpadded slice or a broadcast norm weight) as saved-for-backward tensors. This transform
rewrites the pair of execution traces:

- forward: every saved tensor that is a pure function of one gathered parameter (all-gather, wait,
  then cheap view ops) is dropped from the saved tensors, and the sharded parameter it came from is
  saved instead; deletions are regenerated, so each unsharded parameter dies after its last
  forward use;
- backward: the same all-gather, wait and view ops are replayed (with the same names) after the
  inputs are unpacked. The scheduler then moves them to where they are needed.

A saved gathered parameter that cannot be replayed this way is an error naming the parameter,
not a silent fallback to ZeRO2's memory.

Sharding "auto" keeps some units' gathered parameters saved, as ZeRO2 does, and re-gathers the
rest: which ones is chosen at the first compile, once both traces exist, from their memory
estimate under the budget ([Note: selective unsharding]); later compiles keep that choice. Plain
ZeRO3 keeps what the backward needs first, up to its first block, whose re-gathers no compute
hides, where that costs no memory, chosen the same way ([Note: ZeRO3 keeps what is free]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch.distributed as dist
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform
from thunder.core.transforms import dce

from thunder_overlap._analysis.aliasing import is_view_op
from thunder_overlap._analysis.classify import AnnotatedTrace, CollectiveKind, NodeKind, classify_trace
from thunder_overlap._scheduling.orders import with_deletions
from thunder_overlap._scheduling.prediction import predict_step
from thunder_overlap._scheduling.rank_agreement import agreed_prefix, ranks_where
from thunder_overlap._scheduling.unsharding import (
    MemoryBudgetTooSmall,
    StepPrediction,
    UnshardingChoice,
    choose_free_units,
    choose_kept_units,
    just_in_time_step_peak,
)
from thunder_overlap._transforms._lookup import transform_of
from thunder_overlap._transforms._model_state import ModelState

__all__ = ["Zero3Transform", "RegatherPlan", "gathered_shards", "plan_regather"]

_PARAMETER_CHAIN = (NodeKind.COLLECTIVE, NodeKind.WAIT, NodeKind.EPILOGUE, NodeKind.PROLOGUE)


@dataclass(frozen=True)
class RegatherPlan:
    """What the forward stopped saving and how the backward rebuilds it."""

    # Saved tensors as the backward unpacks them, in order, before and after the rewrite.
    old_saved: tuple[TensorProxy, ...]
    new_saved: tuple[TensorProxy, ...]
    # Forward bound symbols (all-gathers, waits, views) that recompute the dropped tensors.
    replay: tuple[BoundSymbol, ...]
    # Saved gathered parameters (or views of them) that cannot be replayed: (tensor, why).
    unreplayable: tuple[tuple[TensorProxy, str], ...] = ()


def _recompute_slice(annotated: AnnotatedTrace, name: str) -> tuple[set[int] | None, str | None]:
    """Nodes that compute ``name`` from trace inputs through a gathered-parameter chain only, or
    None and why not (it depends on an activation, an expensive op, another collective)."""
    nodes = annotated.nodes
    needed: set[int] = set()
    stack = [name]
    has_allgather = False
    while stack:
        name = stack.pop()
        if annotated.is_input(name):
            continue
        p = annotated.producer[name]
        if p in needed:
            continue
        node = nodes[p]
        if node.kind not in _PARAMETER_CHAIN:
            return None, f"{name} comes from {node.name}, a {node.kind.value} op ZeRO3 does not replay"
        if node.kind is NodeKind.COLLECTIVE:
            if annotated.collectives[node.collective].kind is not CollectiveKind.ALL_GATHER:
                return None, f"{name} comes from {node.name}, which is not an all-gather"
            has_allgather = True
        needed.add(p)
        stack.extend(node.inputs)
    return (needed, None) if has_allgather else (None, "no all-gather computes it")


def _is_gathered_parameter(annotated: AnnotatedTrace, name: str) -> bool:
    """A gathered parameter or a cheap function of gathered parameters only (a view, a cast)."""
    p = annotated.producer.get(name)
    return p is not None and annotated.nodes[p].kind in (NodeKind.WAIT, NodeKind.EPILOGUE)


def gathered_shards(annotated: AnnotatedTrace, name: str) -> list[str]:
    """Names of the trace inputs that all-gathers ``name`` depends on gathered (through a cast,
    under mixed precision), in trace order."""
    shards: set[str] = set()
    seen: set[tuple[int, bool]] = set()
    stack = [(name, False)]
    while stack:
        name, gathered = stack.pop()
        if gathered and annotated.is_input(name):
            shards.add(name)
        p = annotated.producer.get(name)
        if p is None or (p, gathered) in seen:
            continue
        seen.add((p, gathered))
        node = annotated.nodes[p]
        is_gather = node.kind is NodeKind.COLLECTIVE and annotated.collectives[node.collective].kind is CollectiveKind.ALL_GATHER
        stack.extend((i, gathered or is_gather) for i in node.inputs)
    return sorted(shards, key=lambda n: annotated.consumers.get(n, [0])[0])


def saved_tensors_of(annotated: AnnotatedTrace) -> tuple[TensorProxy, ...]:
    """The tensors a forward trace saves for its backward."""
    ret = next(n for n in annotated.nodes if n.kind is NodeKind.RETURN)
    return tuple(ret.bsym.args[1][0])


def plan_regather(annotated: AnnotatedTrace, keep: Callable[[str], bool] | None = None) -> RegatherPlan:
    """Finds the saved tensors of a forward trace that a re-gather in backward can replace, and
    the gathered parameters among them that it cannot. Saved tensors ``keep`` is true of stay
    saved (sharding "auto"'s kept units)."""
    saved_tensors = saved_tensors_of(annotated)
    dropped: set[str] = set()
    replay: set[int] = set()
    unreplayable: list[tuple[TensorProxy, str]] = []
    for t in saved_tensors:
        if keep is not None and keep(t.name):
            continue
        chain, why_not = _recompute_slice(annotated, t.name)
        if chain is not None:
            dropped.add(t.name)
            replay |= chain
        elif _is_gathered_parameter(annotated, t.name):
            unreplayable.append((t, why_not))

    kept = [t for t in saved_tensors if t.name not in dropped]
    kept_names = {t.name for t in kept}
    sharded_inputs: list[TensorProxy] = []
    for i in sorted(replay):
        for a in annotated.nodes[i].bsym.flat_proxy_args:
            if isinstance(a, TensorProxy) and annotated.is_input(a.name) and a.name not in kept_names:
                kept_names.add(a.name)
                sharded_inputs.append(a)
    return RegatherPlan(
        old_saved=tuple(saved_tensors),
        new_saved=tuple(kept + sharded_inputs),
        replay=tuple(annotated.nodes[i].bsym for i in sorted(replay)),
        unreplayable=tuple(unreplayable),
    )


def _rewrite_forward(trace: TraceCtx, plan: RegatherPlan) -> TraceCtx:
    new_trace = from_trace(trace)
    bsyms = []
    for bsym in trace.bound_symbols:
        if bsym.sym.id is prims.PrimIDs.DEL:  # regenerated below, after dead code is gone
            continue
        if bsym.sym.id is prims.PrimIDs.RETURN:
            outputs, (_, saved_other) = bsym.args
            bsym = bsym.from_bsym(args=(outputs, (plan.new_saved, saved_other)))
        bsyms.append(bsym)
    new_trace.bound_symbols = bsyms
    # Views that only fed the dropped tensors would otherwise keep their gathered parameter alive.
    new_trace = with_deletions(dce(new_trace))
    new_trace.set_provenance(TraceProvenance("thunder_overlap: ZeRO3 saves sharded parameters"))
    return new_trace


def _rewrite_backward(trace: TraceCtx, plan: RegatherPlan) -> TraceCtx:
    """Unpacks ``plan.new_saved`` instead of the old saved tensors and replays the re-gathers
    right after that unpack; the scheduler then moves each to where it is needed. With nothing to
    replay the backward stays as it is (it may unpack no saved tensor at all)."""
    if not plan.replay:
        return trace
    old_names = [t.name for t in plan.old_saved]
    new_trace = from_trace(trace)
    bsyms: list[BoundSymbol] = []
    unpacked = False
    for bsym in trace.bound_symbols:
        if bsym.sym.id is prims.PrimIDs.UNPACK_SEQUENCE and [o.name for o in bsym.flat_proxy_outs] == old_names:
            collection, _ = bsym.args
            bsyms.append(bsym.from_bsym(args=(collection, len(plan.new_saved)), output=list(plan.new_saved)))
            bsyms.extend(plan.replay)
            unpacked = True
        else:
            bsyms.append(bsym)
    if not unpacked:
        raise RuntimeError(
            "thunder_overlap ZeRO3: the backward trace does not unpack the forward's saved tensors "
            f"({len(old_names)} tensors starting {old_names[:3]}); cannot re-gather parameters"
        )
    new_trace.bound_symbols = bsyms
    new_trace = with_deletions(new_trace, clear_collections=True)
    new_trace.set_provenance(TraceProvenance("thunder_overlap: ZeRO3 re-gathers parameters"))
    return new_trace


class Zero3Transform(Transform):
    """Makes the forward save sharded parameters and the backward re-gather them; with
    ``selective``, only the parameters of the units the budget has no room for (sharding "auto").
    Plain ZeRO3 keeps what the backward needs first, up to its first block, where that costs no
    memory ([Note: ZeRO3 keeps what is free]; ``Tuning.zero3_keeps_free_units=False`` keeps none).

    ``state`` is the model's (:class:`ModelState`): which parameter each input is (errors name
    parameters), and for ``selective`` the units (its blocks and buckets), the budget, the
    schedule that prices a choice and the ranks to agree with ([Note: rank agreement]).
    Raises when the forward would still save a gathered parameter that it cannot re-gather,
    rather than quietly keeping ZeRO2's memory. After the first compile, :attr:`choice` says which
    units were kept and why.
    """

    def __init__(self, state: ModelState, *, selective: bool = False) -> None:
        if selective and state.config.memory_budget_bytes is None:
            raise ValueError("sharding 'auto' needs OverlapConfig.memory_budget_bytes")
        self.state = state
        self.selective = selective
        self.choice: UnshardingChoice | None = None
        self._pending: RegatherPlan | None = None
        # Parameter name -> the block holding it (a module prefix), from the model.
        self._block_of_parameter: dict[str, str] = {}
        # The first compile's forward, until its backward decides what it saves.
        self._deferred: tuple[AnnotatedTrace, TraceCtx] | None = None

    @staticmethod
    def of(module) -> Zero3Transform | None:
        """The ZeRO3 transform of a module ``thunder_overlap.fsdp`` returned, if any."""
        return transform_of(module, Zero3Transform)

    def transform_module(self, model) -> None:
        if not (self.selective or self.state.config.tuning.zero3_keeps_free_units):
            return
        for prefix, block in self.state.find_blocks(model._model):
            for name, _ in block.named_parameters():
                self._block_of_parameter[f"{prefix}.{name}"] = prefix

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        self.state.record_inputs(prologue_trace, computation_trace)
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        if TraceTag.AUGMENTED_FORWARD in computation_trace.tags:
            # Thunder calls this hook for the forward, then for its backward, in one compilation.
            annotated = classify_trace(computation_trace)
            plan = plan_regather(annotated, self._keeps(annotated))
            if plan.unreplayable:
                raise RuntimeError(self._unreplayable_message(annotated, plan))
            self._deferred = None
            chooses = self.selective or self.state.config.tuning.zero3_keeps_free_units
            if self.choice is None and chooses:
                # [Note: selective unsharding]: this very trace is rewritten again by the backward's
                # hook, which Thunder calls before any later transform sees the forward. Chosen at
                # the first compile, every rank there, even with nothing to keep: a later compile
                # may be one rank's alone and cannot exchange.
                forward = _rewrite_forward(computation_trace, plan)
                self._deferred = (annotated, forward)
                self._pending = plan
                return forward
            if not plan.replay:  # the forward saves no gathered parameter: nothing to re-gather
                self._pending = None
                return computation_trace
            self._pending = plan
            return _rewrite_forward(computation_trace, plan)
        if TraceTag.BACKWARD in computation_trace.tags and self._pending is not None:
            plan, self._pending = self._pending, None
            if self._deferred is not None:
                plan = self._choose(computation_trace)
            return _rewrite_backward(computation_trace, plan)
        return computation_trace

    def kept_parameters(self) -> frozenset[str]:
        """The parameters the forward saves gathered for the backward, which it does not
        re-gather: the kept units' (none before the first compile, nor when none was kept)."""
        if self.choice is None or not self.choice.kept:
            return frozenset()
        kept = set(self.choice.kept)
        return frozenset(p for name, p in self.state.parameter_of_input.items() if self._unit_of_input(name) in kept)

    # --- the units kept gathered to the backward ---------------------------------------------

    def _keeps(self, annotated: AnnotatedTrace) -> Callable[[str], bool] | None:
        """Which saved tensors stay saved: those of the kept units, once chosen."""
        return None if self.choice is None else _keeping(self._units_of_saved(annotated, self.state), self.choice.kept)

    def _unit_of_input(self, name: str, state: ModelState | None = None) -> str:
        """The unit input ``name`` belongs to under ``state``'s buckets (default: the model's):
        its bucket (a bucket is gathered whole), else its block, else the parameter itself."""
        state = state or self.state
        parameter = state.parameter_of_input.get(name, name)
        bucket = state.bucket_of_parameter(parameter)
        if bucket is not None:
            return bucket.plan.label
        return self._block_of_parameter.get(parameter, parameter)

    def _units_of_saved(self, annotated: AnnotatedTrace, state: ModelState) -> dict[str, frozenset[str]]:
        """Saved tensor name -> the units whose gathered parameters it is computed from."""
        units = {}
        for tensor in saved_tensors_of(annotated):
            replayable = _recompute_slice(annotated, tensor.name)[0] is not None
            if replayable or _is_gathered_parameter(annotated, tensor.name):
                units[tensor.name] = frozenset(self._unit_of_input(s, state) for s in gathered_shards(annotated, tensor.name))
        return units

    def _pricing(self, state: ModelState, annotated: AnnotatedTrace, backward: TraceCtx) -> _Pricing:
        inputs = state.parameter_of_input.items()
        block_units = {self._unit_of_input(name, state) for name, parameter in inputs if parameter in self._block_of_parameter}
        return _Pricing(state, annotated, backward, self._units_of_saved(annotated, state), block_units)

    def _local_choice(self, pricing: _Pricing) -> UnshardingChoice:
        """This rank's choice under ``pricing``'s buckets, before any agreement."""
        config = self.state.config
        if self.selective:
            return choose_kept_units(pricing.candidates, pricing.unit_bytes, pricing.peak_of, config.memory_budget_bytes, pricing.predict)
        # Keeping can still cost time where a budget reads memory: kept units hold room the
        # backward's prefetching would have had ([Note: ZeRO3 keeps what is free]).
        timed = pricing.predict_free if config.policy.reads_memory else None
        return choose_free_units(pricing.candidates, pricing.unit_bytes, pricing.peak_of, pricing.block_units, timed)

    def _choose(self, backward: TraceCtx) -> RegatherPlan:
        """Chooses the kept units from both traces' estimates (and, for ``"auto"`` buckets, the
        faster of its plan and block buckets, each with its own choice: [Note: auto against
        block]), agrees on them with the other ranks, rewrites the deferred forward in place and
        returns the backward's plan."""
        annotated, forward_out = self._deferred
        self._deferred = None
        state = self.state
        exchange = state.config.tuning.check_ranks_agree
        group = state.agreement_group_of(annotated)
        state.agree_settings_once(group)
        def local_choice(candidate: ModelState) -> tuple[_Pricing, UnshardingChoice | MemoryBudgetTooSmall]:
            pricing = self._pricing(candidate, annotated, backward)
            try:
                return pricing, self._local_choice(pricing)
            except MemoryBudgetTooSmall as error:
                return pricing, error

        priced: list[tuple[_Pricing, UnshardingChoice | MemoryBudgetTooSmall]] = []

        def step_ms_of(candidate: ModelState) -> float:
            pricing, choice = local_choice(candidate)
            priced.append((pricing, choice))
            if isinstance(choice, MemoryBudgetTooSmall):
                return math.inf
            return pricing.step_ms(choice, floored=not self.selective)

        if state.plan_alternative is not None:
            pricing, choice = priced[1] if state.choose_plan(step_ms_of, group) else priced[0]
        else:
            pricing, choice = local_choice(state)
        if isinstance(choice, MemoryBudgetTooSmall):
            if exchange:
                agreed_prefix(None, group)  # so that the other ranks stop too
            raise choice
        if self.selective:
            choice = self._agreed_within_budget(choice, pricing, group if exchange else None)
        else:
            if exchange:  # every prefix of each rank's choice is free on it
                kept = agreed_prefix(choice.kept, group).common
                if kept != choice.kept:
                    scheduled = pricing.predict_free(kept) if choice.scheduled is not None else None
                    choice = _narrowed(choice, kept, pricing.peak_of(kept), pricing.unit_bytes, scheduled)
            if choice.kept:
                state.regather_all_peak_bytes = choice.zero3_peak_bytes
        self.choice = choice
        plan = pricing.plan_for(choice.kept)
        forward_out.bound_symbols = _rewrite_forward(annotated.trace, plan).bound_symbols
        return plan

    def _agreed_within_budget(self, choice: UnshardingChoice, pricing: _Pricing, group: dist.ProcessGroup | None) -> UnshardingChoice:
        """Sharding "auto"'s choice, agreed with the ranks of ``group`` (None: this rank's own)."""
        if group is None:
            return choice
        budget = self.state.config.memory_budget_bytes
        agreement = agreed_prefix(choice.kept, group)
        if agreement.failed:
            raise MemoryBudgetTooSmall(
                f"thunder_overlap sharding 'auto': ranks {agreement.failed} have no room for ZeRO3 itself, nor for "
                f"keeping units, under memory_budget_bytes={budget} (their own error names their predicted peaks); "
                "every rank stops"
            )
        if not agreement.unanimous:  # another rank has less room (its own batch shape)
            kept = agreement.common
            peak = pricing.peak_of(kept)
            # Keeping fewer units mostly needs less memory, not always (fewer kept, more re-gathered).
            over = ranks_where(peak > budget, group)
            if over:
                raise MemoryBudgetTooSmall(
                    f"thunder_overlap sharding 'auto': the {len(kept)} units every rank has room for are predicted over "
                    f"memory_budget_bytes={budget} on ranks {over} (this rank: {peak} B); every rank stops. Raise the "
                    "budget, or give the ranks batches of one shape"
                )
            if kept != choice.kept:
                scheduled = pricing.predict(kept) if choice.scheduled is not None else None
                choice = _narrowed(choice, kept, peak, pricing.unit_bytes, scheduled)
        return choice

    def _unreplayable_message(self, annotated: AnnotatedTrace, plan: RegatherPlan) -> str:
        problems = []
        for tensor, why in plan.unreplayable:
            shards = gathered_shards(annotated, tensor.name)
            parameters = ", ".join(self.state.parameter_of_input.get(s, s) for s in shards) or "an unknown parameter"
            problems.append(f"{tensor.name} (gathered from {parameters}): {why}")
        return (
            "thunder_overlap ZeRO3: the forward saves these gathered parameters for backward and cannot re-gather "
            f"them there, so they would stay unsharded between forward and backward (ZeRO2's memory): "
            f"{'; '.join(problems)}. Use sharding_strategy='zero2' for this model."
        )


class _Pricing:
    """The units of one bucketing (the model's, or a candidate's: [Note: auto against block]) and
    the step each choice of kept units makes, as the bucketing transform will run it (the pool
    counts), each peak and step computed once."""

    def __init__(
        self, state: ModelState, annotated: AnnotatedTrace, backward: TraceCtx, units: dict[str, frozenset[str]], block_units: set[str]
    ) -> None:
        self.state, self.annotated, self.backward, self.units, self.block_units = state, annotated, backward, units, block_units
        self.candidates, self.unit_bytes = _candidates(annotated, classify_trace(backward), units)
        self._steps: dict[tuple[str, ...], tuple[TraceCtx, TraceCtx]] = {}
        self._peaks: dict[tuple[str, ...], int] = {}

    def plan_for(self, kept: tuple[str, ...]) -> RegatherPlan:
        return plan_regather(self.annotated, _keeping(self.units, kept))

    def step_for(self, kept: tuple[str, ...]) -> tuple[TraceCtx, TraceCtx]:
        if kept not in self._steps:
            plan = self.plan_for(kept)
            step = _rewrite_forward(self.annotated.trace, plan), _rewrite_backward(self.backward, plan)
            for trace in step:  # names pricing makes (coalesced launches) stay out of the traces that run
                trace.names = set(trace.names)
            self._steps[kept] = self.state.bucketed(*step)
        return self._steps[kept]

    def peak_of(self, kept: tuple[str, ...]) -> int:
        if kept not in self._peaks:
            self._peaks[kept] = just_in_time_step_peak(*self.step_for(kept), self.state.layouts)
        return self._peaks[kept]

    def predict(self, kept: tuple[str, ...], basis_floor_bytes: int | None = None) -> StepPrediction:
        state = self.state
        return predict_step(
            state.config,
            *self.step_for(kept),
            state.layouts,
            prefetch_unit_bytes=state.prefetch_unit_bytes,
            basis_floor_bytes=basis_floor_bytes,
        )

    def predict_free(self, kept: tuple[str, ...]) -> StepPrediction:
        """The step as it runs where ``kept`` is plain ZeRO3's choice: budgets floored at its
        peak with nothing kept."""
        return self.predict(kept, self.peak_of(()) if kept else None)

    def step_ms(self, choice: UnshardingChoice, *, floored: bool) -> float:
        """The predicted step of ``choice`` (``floored``: plain ZeRO3's, see :meth:`predict_free`)."""
        if choice.scheduled is not None:
            return choice.scheduled.step_ms
        return (self.predict_free(choice.kept) if floored else self.predict(choice.kept)).step_ms


def _narrowed(
    choice: UnshardingChoice, kept: tuple[str, ...], peak_bytes: int, unit_bytes: Mapping[str, int], scheduled: StepPrediction | None = None
) -> UnshardingChoice:
    """``choice`` cut to the prefix ``kept`` that every rank chose."""
    saved = sum(unit_bytes[unit] for unit in kept)
    return replace(choice, kept=kept, peak_bytes=peak_bytes, scheduled=scheduled, regather_bytes_saved=saved, kept_alone=choice.kept)


def _keeping(units: Mapping[str, frozenset[str]], kept: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a saved tensor stays saved: it is computed from gathered parameters of kept units only."""
    kept_set = set(kept)
    return lambda name: bool(units.get(name)) and units[name] <= kept_set


def _first_computed_from(backward: AnnotatedTrace, name: str, end: int) -> int:
    """Where the backward first computes from ``name``: its first compute consumer that is not a
    view, following views. A checkpointed block's recomputation takes views of its norms' weights
    (unsqueeze) at the backward's start, long before the block computes with them."""
    first, pending, seen = end, [name], set()
    while pending:
        for i in backward.consumers.get(pending.pop(), []):
            node = backward.nodes[i]
            if node.kind is not NodeKind.COMPUTE or i in seen:
                continue
            seen.add(i)
            if is_view_op(node.name):
                pending.extend(node.outputs)
            else:
                first = min(first, i)
    return first


def _candidates(
    forward: AnnotatedTrace, backward: AnnotatedTrace, units: Mapping[str, frozenset[str]]
) -> tuple[list[str], dict[str, int]]:
    """The units in the order the backward first computes with them (a tied embedding, which the
    output head's gradient needs, before the last block), and each one's gathered bytes: what
    keeping it saves re-gathering."""
    end = len(backward.nodes)
    needed_at: dict[str, int] = {}
    gathers: dict[str, set[int]] = {}
    for name, owners in units.items():
        first_use = _first_computed_from(backward, name, end)
        chain, _ = _recompute_slice(forward, name)
        for unit in owners:
            needed_at[unit] = min(needed_at.get(unit, end), first_use)
            gathers.setdefault(unit, set()).update(i for i in chain or () if forward.nodes[i].kind is NodeKind.COLLECTIVE)
    collectives = forward.collectives
    unit_bytes = {unit: sum(collectives[forward.nodes[i].collective].unsharded_bytes for i in nodes) for unit, nodes in gathers.items()}
    return sorted(needed_at, key=needed_at.__getitem__), unit_bytes
