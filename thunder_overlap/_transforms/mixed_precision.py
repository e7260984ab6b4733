"""Mixed precision: parameters gathered in ``param_dtype``, gradients reduced in ``reduce_dtype``.

Runs right after Thunder's FSDPTransform, on the computation trace before autodiff, so that the
gradient rules are this module's ([Note: mixed precision]):

- each ``synchronize`` of a sharded floating parameter that the policy casts becomes
  ``synchronize_mixed``: forward, the shard is cast (``shard_cast``) and the cast all-gathered;
  backward, the gradient is cast to the reduce dtype, pre-averaged and reduce-scattered, and the
  reduced shard cast back to the parameter's dtype;
- the forward's floating arguments are cast to ``param_dtype`` (module state is not);
- every later op that reads a changed tensor is traced again on the new tensors, so Thunder's own
  meta functions derive every dtype downstream; a matmul-like op whose inputs mix the gathered
  dtype with a wider one runs in the gathered dtype (autocast's rule, listed in ``downcasts``);
  any other op that refuses the new dtypes is an error naming it.

Parameters and their ``.grad`` keep their dtypes; the prologue (its checks of the float32 shards
and inputs) and the epilogue are left as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from thunder.core import dtypes, prims
from thunder.core.proxies import DistParallelType, Proxy, TensorProxy
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform
from thunder.core.transforms import register_augmented_forward, register_backward
from thunder.distributed import prims as dist_prims

from thunder_overlap._ops import shard_cast
from thunder_overlap.options import BucketingStrategy, MixedPrecision, own_dtype_reducers

__all__ = ["MixedPrecisionTransform", "synchronize_mixed"]

logger = logging.getLogger(__name__)

_SYNCHRONIZE_MIXED_ID = "thunder_overlap.synchronize_mixed"
# Prologue ops that read the module's own state rather than the call's arguments.
_MODULE_STATE_IDS = (prims.PrimIDs.UNPACK_PARAMETER, prims.PrimIDs.UNPACK_BUFFER, prims.PrimIDs.UNPACK_ATTR)
# Ops that run in the gathered weights' dtype when their other inputs are wider, as under
# autocast ([Note: mixed precision]).
_MATMUL_OPS = frozenset(
    ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "scaled_dot_product_attention", "conv1d", "conv2d", "conv3d", "einsum")
)
# Computation-trace ops that bind its inputs: kept as they are, never traced again.
_HEADER_IDS = (prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.UNPACK_SEQUENCE)


def _gather(shard: TensorProxy, group: dist.ProcessGroup, gather_dtype: dtypes.dtype) -> TensorProxy:
    return dist_prims.all_gather(shard_cast(shard, gather_dtype), group, True).wait()


def _synchronize_mixed_meta(shard, group, gather_dtype, reduce_dtype) -> TensorProxy:
    # What runs where no gradient is needed (a frozen parameter): the forward alone.
    return _gather(shard, group, gather_dtype)


synchronize_mixed = Symbol(name="synchronize_mixed", id=_SYNCHRONIZE_MIXED_ID, meta=_synchronize_mixed_meta, is_prim=False)


@register_augmented_forward(_SYNCHRONIZE_MIXED_ID)
def _synchronize_mixed_forward(shard, group, gather_dtype, reduce_dtype):
    return _gather(shard, group, gather_dtype), (group, shard.dtype, reduce_dtype)


@register_backward(_SYNCHRONIZE_MIXED_ID)
def _synchronize_mixed_backward(group, shard_dtype, reduce_dtype, grad):
    # As Thunder's synchronize: pre-average, then sum, in the reduce dtype.
    if grad.dtype != reduce_dtype:
        grad = prims.convert_element_type(grad, reduce_dtype)
    reduced = dist_prims.reduce_scatter(grad / group.size(), dist_prims.DistributedReduceOps.SUM, group, True).wait()
    if reduced.dtype != shard_dtype:
        reduced = prims.convert_element_type(reduced, shard_dtype)
    return reduced, None, None, None


@dataclass(frozen=True)
class _Casts:
    """What the retrace changes: per gathered input, (gather dtype, reduce dtype); forward
    arguments cast to ``argument_dtype`` (None: none)."""

    synchronized: dict[str, tuple[dtypes.dtype, dtypes.dtype]]
    arguments: tuple[str, ...]
    argument_dtype: dtypes.dtype | None


def _thunder_dtypes(policy: MixedPrecision, dtype: dtypes.dtype) -> tuple[dtypes.dtype, dtypes.dtype] | None:
    pair = policy.dtypes_for(dtypes.to_torch_dtype(dtype))
    return None if pair is None else (dtypes.to_dtype(pair[0]), dtypes.to_dtype(pair[1]))


def _is_sharded_synchronize(bsym: BoundSymbol) -> bool:
    return bsym.sym.id is dist_prims.PrimIDs.SYNCHRONIZE and bsym.args[2] is DistParallelType.FULLY_SHARDED


def _forward_arguments(prologue_trace: TraceCtx, computation_trace: TraceCtx) -> list[TensorProxy]:
    """The computation's floating tensor inputs that come from the call's arguments (not the
    module's parameters, buffers or attributes), as FSDP2's ``cast_forward_inputs`` casts them."""
    producers = {o.name: b for b in prologue_trace.bound_symbols for o in b.flat_proxy_outs}
    arguments = []
    for out, inp in zip(prologue_trace.output[0], computation_trace.args, strict=True):
        bsym = producers.get(getattr(out, "name", None))
        if bsym is not None and bsym.sym.id in _MODULE_STATE_IDS:
            continue
        if isinstance(inp, TensorProxy) and dtypes.is_float_dtype(inp.dtype):
            arguments.append(inp)
    return arguments


def _plan_casts(policy: MixedPrecision, prologue_trace: TraceCtx, computation_trace: TraceCtx) -> _Casts | None:
    """The casts ``policy`` asks of these traces; None when it casts no parameter."""
    synchronized = {}
    for bsym in computation_trace.bound_symbols:
        if _is_sharded_synchronize(bsym):
            pair = _thunder_dtypes(policy, bsym.args[0].dtype)
            if pair is not None:
                synchronized[bsym.args[0].name] = pair
    if not synchronized:
        return None
    argument_dtype = None if policy.param_dtype is None else dtypes.to_dtype(policy.param_dtype)
    arguments = () if argument_dtype is None else _forward_arguments(prologue_trace, computation_trace)
    names = tuple(a.name for a in arguments if a.dtype != argument_dtype)
    return _Casts(synchronized, names, argument_dtype)


def _dtype_name(dtype: dtypes.dtype) -> str:
    return str(dtypes.to_torch_dtype(dtype)).removeprefix("torch.")


def _where(bsym: BoundSymbol) -> str:
    """The op and the model's source line that traced it, as far as Thunder recorded it."""
    line = getattr(bsym.source_positions, "lineno", None)
    if bsym.source_filename is None or line is None:
        return bsym.sym.name
    return f"{bsym.sym.name} at {bsym.source_filename.rsplit('/', 1)[-1]}:{line}"


def _refused_op_message(bsym: BoundSymbol, args, casts: _Casts, origin: dict[str, BoundSymbol], error: Exception) -> str:
    tensors = [a for a in tree_flatten(args)[0] if isinstance(a, TensorProxy)]
    inputs = ", ".join(f"{a.name}: {_dtype_name(a.dtype)}" for a in tensors)
    others = [a for a in tensors if a.name in origin and a.dtype != casts.argument_dtype]
    sources = "; ".join(f"{a.name} comes from {_where(origin[a.name])}" for a in others)
    gathered = "their gather dtype" if casts.argument_dtype is None else _dtype_name(casts.argument_dtype)
    return (
        f"thunder_overlap mixed precision: {_where(bsym)} refuses its inputs once parameters are gathered in "
        f"{gathered} ({inputs}): {error}{'. ' + sources if sources else ''}. Only the forward's arguments and the "
        "gathered parameters change dtype. A dtype the trace holds as a constant does not: one read from a tensor "
        "when the model was traced (x.to(x.dtype), common in RMSNorm and rotary embeddings) or a buffer's that "
        "promotes activations (FSDP2 would cast them again at the next fully_shard module). Cast with "
        "y.type_as(x) or buffer.type_as(activation) instead, or leave mixed_precision out."
    )


def _downcast_matmul_inputs(bsym: BoundSymbol, args, kwargs, dtype: dtypes.dtype | None, downcasts: list[str]):
    """A matmul-like op whose floating inputs mix ``dtype`` (a gathered weight's) with a wider
    one gets them all in ``dtype``, as autocast runs matmuls ([Note: mixed precision]); the op
    and its source line are added to ``downcasts``."""
    if dtype is None or bsym.sym.name not in _MATMUL_OPS:
        return args, kwargs
    floats = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, TensorProxy) and dtypes.is_float_dtype(t.dtype)]
    others = [t for t in floats if not dtypes.are_same_dtypes(t.dtype, dtype)]
    if not others or len(others) == len(floats):
        return args, kwargs
    downcasts.append(f"{_where(bsym)} ({', '.join(sorted({_dtype_name(t.dtype) for t in others}))} inputs)")

    def down(x):
        if isinstance(x, TensorProxy) and any(x is t for t in others):
            return prims.convert_element_type(x, dtype)
        return x

    return tree_map(down, args), tree_map(down, kwargs)


def _retrace(computation_trace: TraceCtx, casts: _Casts, downcasts: list[str]) -> TraceCtx:
    """``computation_trace`` with the casts of ``casts`` and every op traced again after them;
    each matmul whose inputs were downcast is added to ``downcasts``."""
    new_trace = from_trace(computation_trace)
    swapped: dict[str, Proxy] = {}
    # New tensor name -> the original op it replaces, for errors that point at the model's code.
    origin: dict[str, BoundSymbol] = {}

    def read(x):
        return swapped.get(x.name, x) if isinstance(x, Proxy) else x

    bsyms = computation_trace.bound_symbols
    body = next(i for i, bsym in enumerate(bsyms) if bsym.sym.id not in _HEADER_IDS)
    new_trace.bound_symbols = list(bsyms[:body])
    with tracectx(new_trace):
        for name in casts.arguments:
            argument = next(a for a in computation_trace.args if getattr(a, "name", None) == name)
            swapped[name] = prims.convert_element_type(argument, casts.argument_dtype)
        for bsym in bsyms[body:]:
            if bsym.sym.id is prims.PrimIDs.RETURN:
                new_trace.bound_symbols.append(bsym.from_bsym(args=_remapped_return(bsym.args, read)))
                continue
            if _is_sharded_synchronize(bsym) and bsym.args[0].name in casts.synchronized:
                shard, group, _ = bsym.args
                out = synchronize_mixed(shard, group, *casts.synchronized[shard.name])
            elif not any(a.name in swapped for a in bsym.flat_proxy_args):
                # Untouched by the casts: kept as traced (fewer ops re-run, none needlessly).
                new_trace.bound_symbols.append(bsym)
                continue
            else:
                args, kwargs = tree_map(read, bsym.args), tree_map(read, bsym.kwargs)
                args, kwargs = _downcast_matmul_inputs(bsym, args, kwargs, casts.argument_dtype, downcasts)
                try:
                    out = bsym.sym(*args, **kwargs)
                except Exception as error:
                    raise RuntimeError(_refused_op_message(bsym, args, casts, origin, error)) from error
            olds, news = tree_flatten(bsym.output)[0], tree_flatten(out)[0]
            for old, new in zip(olds, news, strict=True):
                if isinstance(old, Proxy) and isinstance(new, Proxy) and old.name != new.name:
                    swapped[old.name], origin[new.name] = new, bsym
    new_trace.set_provenance(TraceProvenance("thunder_overlap: mixed precision"))
    return new_trace


def _remapped_return(args: tuple, read) -> tuple:
    # Only the output changes: flat_args are the inputs as the caller passed them (Thunder and
    # the trace rewrites after this one read them back by name).
    (value,) = args
    if isinstance(value, dict) and "output" in value:
        return ({**value, "output": tree_map(read, value["output"])},)
    return tree_map(read, args)


class MixedPrecisionTransform(Transform):
    """Casts gathered parameters and forward arguments to ``policy.param_dtype`` and reduces
    gradients in ``policy.reduce_dtype`` (see :class:`thunder_overlap.MixedPrecision`).

    ``bucketing`` and ``hybrid``: what the other transforms do. Buckets gather in ``param_dtype``
    but reduce in the parameters' own dtype, as HSDP all-reduces, so with either a policy whose
    ``reduce_dtype`` is not the parameters' is refused.
    """

    def __init__(self, policy: MixedPrecision, *, bucketing: BucketingStrategy, hybrid: bool) -> None:
        self.policy = policy
        self.bucketing = bucketing
        self.hybrid = hybrid
        # Matmuls whose wider inputs the last retrace downcast to param_dtype: "<op> at <file:line> (<dtypes> inputs)".
        self.downcasts: list[str] = []

    def transform_module(self, model) -> None:
        # Runs when the model is jitted (in fsdp()), after Thunder's FSDP sharded it.
        pairs = {p.dtype: self.policy.dtypes_for(p.dtype) for p in model.parameters()}
        cast = sorted(str(dtype) for dtype, pair in pairs.items() if pair is not None)
        if not cast:
            return
        other_reduce = sorted({f"{pair[1]} for {dtype}" for dtype, pair in pairs.items() if pair is not None and pair[1] != dtype})
        users = own_dtype_reducers(self.bucketing, self.hybrid)
        if other_reduce and users:
            raise ValueError(
                f"mixed_precision={self.policy} casts this model's {' and '.join(cast)} parameters, which is not supported "
                f"yet with {' or '.join(users)} and a reduce_dtype other than the parameters' ({', '.join(other_reduce)}): "
                "they reduce in the parameters' dtype; leave reduce_dtype None or equal to it"
                + (", or use bucketing_strategy='none'" if not self.hybrid else "")
            )

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        casts = _plan_casts(self.policy, prologue_trace, computation_trace)
        if casts is None:
            return prologue_trace, computation_trace, epilogue_trace
        downcasts: list[str] = []
        retraced = _retrace(computation_trace, casts, downcasts)
        if downcasts:
            logger.info("thunder_overlap mixed precision: inputs downcast to %s for %s", casts.argument_dtype, "; ".join(downcasts))
        self.downcasts = downcasts
        return prologue_trace, retraced, epilogue_trace
