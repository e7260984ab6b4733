"""Bounds on float32 rounding, for comparing distributed training with a float64 reference.

Every bound here comes from the computation: float32's unit roundoff ``U = 2**-24`` (a rounding
changes a value by at most ``U`` times its size), how many roundings lie on the way to a value, and
the sizes of what they add up. The rule used throughout is Higham's (*Accuracy and Stability of
Numerical Algorithms*, 2nd ed., chapter 3): a chain of ``n`` roundings changes a value by at most
``gamma(n) = n U / (1 - n U)`` relative; a sum of terms computed in any order, in any grouping
(a rank's share first, another order on another machine), is within ``gamma(n)`` times the sum of
the terms' absolute values of the exact sum. So two machines, two kernels or two reduction orders
may differ by as much as that, and a test must allow it, and nothing more.

``gradient_bound`` bounds one float32 forward and backward; ``OptimizerReplay`` re-runs a rank's
optimizer steps in float64 on the rank's own gradients and bounds, by running error analysis of
PyTorch's single-tensor SGD and AdamW (what ``torch.optim`` runs on CPU tensors), how far float32
may land from it. ``adamw_step_spread`` bounds how far one AdamW step moves when its gradient is
off by a bounded amount: AdamW divides by the gradient's running magnitude, so it can turn a
rounding in a tiny gradient into a large change of the update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

__all__ = ["TINY", "U", "OptimizerReplay", "adam_ratio_bound", "adamw_step_spread", "gamma", "gradient_bound", "rounding_count"]

U = 2.0**-24
# A rounding below float32's smallest normal number errs by up to half the smallest subnormal,
# whatever the value's size: fl(x) = x (1 + d) + t, |d| <= U, |t| <= TINY (Higham, section 2.1).
TINY = 2.0**-150


def gamma(n: int) -> float:
    """The relative error of ``n`` float32 roundings in a chain (Higham's gamma_n)."""
    if n * U >= 1:
        raise ValueError(f"{n} roundings: gamma is unbounded at float32")
    return n * U / (1 - n * U)


def rounding_count(parameters: Iterable[torch.Tensor], *, tokens: int, seq_len: int, world_size: int) -> int:
    """An over-count of the float32 roundings on the longest way from the inputs into one element of a
    gradient averaged over ``world_size`` ranks that each hold ``tokens`` tokens of ``seq_len``:

    - every matrix parameter is a dot product over its columns forward and over its rows backward
      (an embedding with a tied head, or a head, too): rows + columns each;
    - attention sums over at most ``seq_len`` positions (the softmax, its weighted sum of values, and
      both again backward): ``seq_len`` per matrix parameter, more often than attention has;
    - a norm adds up its size for its mean and variance, a bias rounds once per element: the size of
      every vector parameter;
    - a weight's gradient adds up the rank's tokens, and the reduce-scatter and all-reduce add up
      the ranks' shares after dividing each once: ``tokens + world_size + 1``.
    """
    count = tokens + world_size + 1
    for p in parameters:
        count += sum(p.shape[:2]) + seq_len if p.dim() >= 2 else p.numel()
    return count


def gradient_bound(shares: list[torch.Tensor], roundings: int) -> float:
    """How far a float32 gradient averaged over ranks may be from the exact (float64) one.

    ``shares`` are the float64 gradients of each rank's loss at the same parameters (their mean is
    the gradient). Each element is a sum whose terms are as large as the shares' elements: the bound
    is ``gamma(roundings)`` times the largest mean absolute share in the tensor. Per tensor, not per
    element: an element's roundings come from its whole backward path, whose terms can be large where
    the exact result is zero (attention's key bias: the softmax ignores a shift, so its exact gradient
    is 0 while the float32 terms that cancel are as large as the query bias's)."""
    magnitude = torch.stack([s.abs() for s in shares]).mean(0).max().item() if shares[0].numel() else 0.0
    return gamma(roundings) * magnitude


class OptimizerReplay:
    """One optimizer per rank re-run in float64 on the rank's gradients, from the rank's parameters
    before each step (so nothing the comparison allows carries from step to step), with a bound on
    where a float32 run of the same step lands; the optimizer's own state (AdamW's moments) carries,
    and so does the bound on its rounding."""

    def __init__(self, optimizer: str, lr: float, *, eps: float = 1e-8, weight_decay: float | None = None) -> None:
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
        self.optimizer, self.lr, self.eps = optimizer, lr, eps
        # torch.optim.AdamW's default decoupled weight decay; SGD's is 0.
        self.weight_decay = weight_decay if weight_decay is not None else (0.01 if optimizer == "adamw" else 0.0)
        self._params: dict[str, torch.Tensor] = {}
        self._optim: torch.optim.Optimizer | None = None
        self._moment_errors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_state(self, params: dict[str, torch.Tensor], state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Starts from an optimizer state (name -> torch's per-parameter state, e.g. loaded from a
        checkpoint) that the float32 run starts from too: no rounding carried from before."""
        optimizer = self._optimizer_for(params)
        for name, p in self._params.items():
            if name in state:
                optimizer.state[p] = {k: torch.as_tensor(v).double().clone() for k, v in state[name].items()}

    def _optimizer_for(self, params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
        if self._optim is None:
            self._params = {name: nn.Parameter(p.detach().double().clone()) for name, p in params.items()}
            values = list(self._params.values())
            if self.optimizer == "adamw":
                self._optim = torch.optim.AdamW(values, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay, foreach=False)
            else:
                self._optim = torch.optim.SGD(values, lr=self.lr, weight_decay=self.weight_decay, foreach=False)
        return self._optim

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """From ``params`` (a rank's shards before the step) and ``grads`` (its gradient shards; a
        parameter without one is frozen): name -> (the parameter after the step in float64, how far
        float32 may be from it, per element)."""
        optimizer = self._optimizer_for(params)
        before = {}
        for name, p in self._params.items():
            p.data.copy_(params[name].double())  # the rank's values: float32 is exact in float64
            g = grads.get(name)
            p.grad = None if g is None else g.double()
            state = optimizer.state.get(p, {})
            before[name] = (state["exp_avg"].clone(), state["exp_avg_sq"].clone()) if "exp_avg" in state else None
        optimizer.step()
        result = {}
        for name, p in self._params.items():
            x = params[name].double()
            if p.grad is None:
                result[name] = (p.detach().clone(), torch.zeros_like(x))
            elif self.optimizer == "sgd":
                # param.add_(grad, alpha=-lr): lr cast to float32 and the product round, then the sum.
                result[name] = (p.detach().clone(), gamma(2) * (self.lr * p.grad.abs() + p.detach().abs()) + 3 * TINY)
            else:
                result[name] = (p.detach().clone(), self._adamw_error(name, p, x, before[name]))
        return result

    def spread(self, gradient_error: float, grad: torch.Tensor, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """How far an exact step from optimizer ``state`` (torch's per-parameter state before the
        step; None: the first step) lands from the step with ``grad`` when its gradient is off by
        at most ``gradient_error``: lr times it for SGD, ``adamw_step_spread`` for AdamW."""
        if self.optimizer == "sgd":
            return torch.full_like(grad, self.lr * gradient_error)
        state = state or {"step": 0, "exp_avg": torch.zeros_like(grad), "exp_avg_sq": torch.zeros_like(grad)}
        betas = self._optim.param_groups[0]["betas"] if self._optim is not None else (0.9, 0.999)
        step = int(state["step"]) + 1
        return adamw_step_spread(gradient_error, grad, state["exp_avg"], state["exp_avg_sq"], step, lr=self.lr, betas=betas, eps=self.eps)

    def _adamw_error(self, name: str, p: torch.Tensor, x: torch.Tensor, before) -> torch.Tensor:
        """Running error analysis of torch's _single_tensor_adam (decoupled weight decay), per element:
        how far its float32 result may be from the float64 replay, given the same inputs."""
        (beta1, beta2), eps = self._optim.param_groups[0]["betas"], self.eps
        state = self._optim.state[p]
        step = int(state["step"])
        g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
        m_prev, v_prev = before if before is not None else (torch.zeros_like(m), torch.zeros_like(v))
        em_prev, ev_prev = self._moment_errors.get(name, (torch.zeros_like(m), torch.zeros_like(v)))
        # exp_avg.lerp_(grad, 1 - beta1): linear, so earlier errors shrink by beta1; a subtraction,
        # a product (with the weight rounded to float32) and a sum each round.
        # (Each rounding may also underflow: TINY apiece.)
        em = beta1 * em_prev + gamma(4) * (m_prev.abs() + g.abs()) + 4 * TINY
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): five roundings of terms that
        # are all >= 0, so relative to the result.
        ev = beta2 * ev_prev + gamma(5) * v + 5 * TINY
        self._moment_errors[name] = (em, ev)
        bc1, bc2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
        # denom = sqrt(exp_avg_sq) / sqrt(bias_correction2) + eps: |sqrt(a) - sqrt(b)| is at most
        # |a - b| / sqrt(a) and at most sqrt(|a - b|); then three roundings.
        s = v.sqrt() / bc2_sqrt
        es = _sqrt_spread(v, ev) / bc2_sqrt + gamma(3) * s + 3 * TINY
        d = s + eps
        ed = es + gamma(2) * d
        d_low = torch.clamp_min(d - ed, eps * (1 - gamma(2)))  # float32's denominator is never below eps
        # param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1): the quotient, the product
        # (the step size rounded to float32) and the sum round; the weight decay's product before
        # (param.mul_(1 - lr * weight_decay), the factor rounded) rounds twice.
        quotient_error = em / d_low + m.abs() * ed / (d * d_low) + gamma(3) * (m.abs() + em) / d_low + 3 * TINY
        # The weight decay's two roundings and the sum's may underflow too.
        return gamma(2) * x.abs() + (self.lr / bc1) * quotient_error + gamma(1) * p.detach().abs() + 3 * TINY


def _sqrt_spread(a: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """How far sqrt(b) may be from sqrt(a) where |a - b| <= error: |a - b| / (sqrt(a) + sqrt(b))."""
    return torch.minimum(error / a.sqrt().clamp_min(1e-300), error.sqrt())


def adam_ratio_bound(step: int, betas: tuple[float, float]) -> float:
    """The largest |m / bc1| / sqrt(v / bc2) Adam's moments can reach after ``step`` steps from zero:
    m / bc1 and v / bc2 are weighted means, with weights a_i and b_i, of the gradients and their
    squares, so by Cauchy-Schwarz the ratio is at most sqrt(sum a_i^2 / b_i) (1 at step 1)."""
    beta1, beta2 = betas
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    total = sum(((1 - beta1) * beta1**k / bc1) ** 2 / ((1 - beta2) * beta2**k / bc2) for k in range(step))
    return math.sqrt(total)


def adamw_step_spread(
    gradient_error: torch.Tensor | float,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.Tensor:
    """How far an exact AdamW step ``step`` lands from the one with gradient ``grad`` when its
    gradient differs from ``grad`` by at most ``gradient_error``, both starting from the same
    parameters and moments (``exp_avg``, ``exp_avg_sq``: before the step). The update is
    lr m / (bc1 (sqrt(v / bc2) + eps)); a gradient
    off by e moves m by (1 - beta1) e and v by (1 - beta2)(2 |g| e + e^2), and the quotient by the
    change of m over the smallest denominator plus m times the change of the denominator over both
    denominators: tiny where the gradient and its history are large next to e, up to twice the
    largest update (its sign flips) where they are not. Float64 inputs; a per-element bound."""
    beta1, beta2 = betas
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    e = torch.as_tensor(gradient_error, dtype=torch.float64)
    m = beta1 * exp_avg + (1 - beta1) * grad
    v = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    dm = (1 - beta1) * e
    dv = (1 - beta2) * (2 * grad.abs() * e + e * e)
    s = (v / bc2).sqrt()
    ds = _sqrt_spread(v, dv) / math.sqrt(bc2)
    d, d_low = s + eps, (s - ds).clamp_min(0) + eps
    spread = (dm / d_low + m.abs() * ds / (d * d_low)) * (lr / bc1)
    # Neither update exceeds lr times the moments' largest ratio: they differ by at most twice that.
    return spread.clamp_max(2 * lr * adam_ratio_bound(step, betas))
