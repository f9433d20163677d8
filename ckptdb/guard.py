"""The non-finite gradient guard: remember a NaN/Inf without a host sync per step.

Calling ``.item()`` on a gradient norm every step stalls a GPU pipeline, so the
guard keeps its "non-finite seen" flag as a tensor on the norm's own device and
ORs into it with device ops. Only :meth:`NonFiniteGradGuard.tripped`, called
once per checkpoint boundary, reads it back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

ParametersArg = Tensor | Iterable[Tensor]


class NonFiniteGradGuard:
    """Accumulates whether any gradient norm was non-finite since the last reset.

    Given to a :class:`~ckptdb.CheckpointManager` (``guard=``), it blocks the
    publication of a boundary after a NaN or Inf gradient: the manager reads it once
    per boundary, raises :class:`~ckptdb.errors.NonFiniteGradientError` instead of
    saving, and resets it. Calling ``.item()`` on a gradient norm every step would
    stall a GPU pipeline, so the flag stays a tensor on the norm's own device and is
    updated with device operations; only :meth:`tripped` reads it back to the host.

    Args:
        named: A module, or its ``named_parameters()``, to name parameters in the
            error when the guard trips. None (the default): parameters are named by
            position and shape (``param[3](512, 512)``).
    """

    def __init__(self, named: nn.Module | Iterable[tuple[str, Tensor]] | None = None) -> None:
        pairs = named.named_parameters() if isinstance(named, nn.Module) else (named or ())
        self._names: dict[int, str] = {id(p): name for name, p in pairs}
        self._flags: dict[torch.device, Tensor] = {}
        self._host_flag = False
        # per parameter group (ids, names): accumulated per-parameter "all finite" flags
        self._param_flags: dict[tuple[int, ...], tuple[list[str], Tensor]] = {}

    def update(self, total_norm: Tensor | float) -> None:
        """Record ``total_norm``; a tensor stays on its device (no host sync).

        For a loop that computes its gradient norm itself (e.g. the return value of
        ``torch.nn.utils.clip_grad_norm_``); :meth:`observe` calls it, while
        :meth:`clip_grad_norm_` records each parameter's flag itself.

        Args:
            total_norm: A gradient norm: a tensor (any shape; a non-finite element
                trips the guard) or a number, checked at once.
        """
        if not isinstance(total_norm, Tensor):
            if not math.isfinite(float(total_norm)):
                self._host_flag = True
            return
        bad = torch.isfinite(total_norm.detach()).logical_not().any()
        flag = self._flags.get(bad.device)
        self._flags[bad.device] = bad if flag is None else flag.logical_or(bad)

    def observe(self, parameters: ParametersArg, *, skipped: Tensor | None = None) -> None:
        """Record the gradients an optimizer step is about to apply, without changing them.

        For frameworks that own the training step (the Lightning callback feeds
        it from ``on_before_optimizer_step``). Each gradient's max-abs norm is taken
        (finite exactly when every element is, and never overflowing), and the
        parameters with a non-finite one are remembered by name. Everything stays on
        the device; nothing syncs with the host. Parameters without a gradient are
        ignored.

        Args:
            parameters: A tensor or an iterable of tensors (parameters), whose
                ``.grad`` is read.
            skipped: A boolean tensor saying the step will not be applied (a
                GradScaler found inf/NaN and skips it): such a step changed no
                weights, so its gradients count as finite. None (the default): the
                step is applied.
        """
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        positions = {id(p): i for i, p in enumerate(params)}
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params if p.grad is not None]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.device, g.dtype), []).append(i)
        per_group = []
        for idx in groups.values():
            # the max-abs norm is finite exactly when every element is, never overflows
            # (no squares, no float64) and reads each gradient once
            norms = _tensor_norms([grads[i] for i in idx], math.inf)
            if skipped is not None:
                norms = torch.where(skipped.to(norms.device), torch.zeros_like(norms), norms)
            self._record_params([params[i] for i in idx], norms, positions)
            per_group.append(norms.to(grads[0].device))
        self.update(torch.cat(per_group).max())

    @torch.no_grad()  # as torch's: clipping is not part of any graph
    def clip_grad_norm_(
        self, parameters: ParametersArg, max_norm: float, norm_type: float = 2.0
    ) -> Tensor:
        """Overflow-safe ``torch.nn.utils.clip_grad_norm_`` that also updates the guard.

        A drop-in for torch's clipping, with its coefficient and return value, run
        under ``no_grad`` as torch's is. Finite gradients too large for a float32 sum
        of squares give a finite norm instead of a false alarm, and the per-tensor
        norms are combined in float64. The guard learns which parameters had a
        non-finite norm (their flags also make :meth:`tripped` true). On the CPU it
        reads the total norm once per step; on other devices nothing syncs with the
        host.

        Args:
            parameters: A tensor or an iterable of tensors whose ``.grad`` is
                clipped in place; parameters without a gradient are ignored.
            max_norm: The largest total norm the gradients keep; larger ones are
                scaled down to it.
            norm_type: The p of the p-norm (default 2.0; ``inf`` for the max-abs
                norm).

        Returns:
            The total norm of the gradients before clipping, in their dtype, like
                torch (a zero tensor when no parameter has a gradient).
        """
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        positions = {id(p): i for i, p in enumerate(params)}
        params = [p for p in params if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.device, g.dtype), []).append(i)
        if len(groups) == 1 and _narrow_on_cpu(grads[0], norm_type):
            return self._clip_on_cpu(params, grads, max_norm, norm_type, positions)
        first_device = grads[0].device
        per_group = []
        for idx in groups.values():
            norms = _tensor_norms([grads[i] for i in idx], norm_type)
            self._record_params([params[i] for i in idx], norms, positions)
            per_group.append(norms.to(first_device))
        wide = any(dtype == torch.float64 for _, dtype in groups)
        total = _combine(torch.cat(per_group), norm_type, wide=wide)
        _scale([[grads[i] for i in idx] for idx in groups.values()], total, max_norm)
        return total.to(grads[0].dtype)

    def _clip_on_cpu(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        max_norm: float,
        norm_type: float,
        positions: dict[int, int],
    ) -> Tensor:
        """One group of float32 (or narrower) gradients on the CPU, in fewer tensor
        operations than torch's own clipping: the common case, every training step.

        The host is the device here, so the total is read once. For a
        p-norm with 1 <= p <= 2 it is finite exactly when every per-tensor norm is:
        then there is nothing to record (a flag only ever turns false), and the
        coefficient is torch's, ``max_norm / (total + 1e-6)`` clamped at 1, as a
        number; a multiplication by exactly 1 changes no value, so it is
        skipped. Otherwise (a float32 sum of squares that overflowed, or a
        gradient that is not finite) the norms are taken again in float64 and
        the parameters recorded, as on any other device.
        """
        norms = _norms(grads, norm_type, torch.float32)
        total = _combine(norms, norm_type, wide=False)
        value = total.item()  # the one read of a value on the CPU, where nothing waits
        if math.isfinite(value):
            coef = float(max_norm) / (value + 1e-6)
            if not coef >= 1.0:  # NaN too: torch's clamp keeps it
                torch._foreach_mul_(grads, coef)
        else:
            norms = _norms(grads, norm_type, torch.float64)
            self._record_params(params, norms, positions)
            total = _combine(norms, norm_type, wide=False)
            _scale([grads], total, max_norm)
        return total.to(grads[0].dtype)

    def _record_params(
        self, params: list[Tensor], norms: Tensor, positions: dict[int, int]
    ) -> None:
        """AND each parameter's "its norm was finite" into its flag."""
        key = tuple(id(p) for p in params)
        finite = torch.isfinite(norms)
        known = self._param_flags.get(key)
        if known is None:
            names = [
                self._names.get(id(p), f"param[{positions[id(p)]}]{tuple(p.shape)}") for p in params
            ]
            self._param_flags[key] = (names, finite)
        else:
            self._param_flags[key] = (known[0], known[1].logical_and(finite))

    def tripped(self) -> bool:
        """Whether a non-finite norm was seen since the last reset (one host sync).

        The manager calls it once per boundary; calling it every step would bring
        back the host sync the guard exists to avoid.

        Returns:
            True when a non-finite gradient norm was recorded since :meth:`reset`.
        """
        if self._host_flag or any(bool(flag.item()) for flag in self._flags.values()):
            return True
        return any(not bool(finite.all().item()) for _, finite in self._param_flags.values())

    def nonfinite_parameters(self) -> list[str]:
        """Names of parameters whose gradient norm was non-finite since the last reset.

        Known for the parameters passed through :meth:`clip_grad_norm_` or
        :meth:`observe`, not for a norm given to :meth:`update`. Reads the flags back
        to the host.

        Returns:
            The names (from ``named``, else by position and shape); empty when none
                is known.
        """
        found: list[str] = []
        for names, flags in self._param_flags.values():
            found.extend(name for name, ok in zip(names, flags.tolist(), strict=True) if not ok)
        return found

    def reset(self) -> None:
        """Forget everything recorded: the guard starts clean for the next boundary.

        The manager resets it at each boundary once its verdict is read (a boundary
        refused for bad input leaves it as it was).
        """
        self._flags.clear()
        self._host_flag = False
        self._param_flags.clear()


def _tensor_norms(grads: list[Tensor], norm_type: float) -> Tensor:
    """Per-tensor norms, stacked, finite for every finite gradient (no false alarm).

    The max-abs norm (``inf``) needs no accumulation and stays in the grads'
    dtype. On the CPU the norms are taken in float32 and recomputed in float64
    only when one is not finite (:func:`_cpu_norms`). On an accelerator a fused
    float64 ``_foreach_norm`` reads each gradient once, with no host sync: a
    float32 pass would need a second one, chosen with ``torch.where`` after
    the fact, to be as safe, and the norm is bound by memory there, not by
    the width of the sum.
    """
    device = grads[0].device.type
    if math.isinf(norm_type):
        if device != "cuda":  # the CPU's max-abs kernels are slow: min and max in one pass
            return torch.stack([torch.stack(torch.aminmax(g)).abs().max() for g in grads])
        return torch.stack(torch._foreach_norm(grads, math.inf))
    if device == "cpu":
        return _cpu_norms(grads, norm_type)
    if device != "mps":  # MPS has no float64
        return torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float64))
    scale = torch.stack(torch._foreach_norm(grads, math.inf)).max().clamp(min=1e-30)
    scaled = torch._foreach_div(grads, scale)
    return torch.stack([n * scale for n in torch._foreach_norm(scaled, norm_type)])


def _cpu_norms(grads: list[Tensor], norm_type: float) -> Tensor:
    """float32 norms (3x faster than float64 here); float64 only for a group in which
    one is not finite: a float32 sum of squares that overflowed although every
    gradient is finite, or a gradient that really is not finite.

    The one branch on a value: on the CPU the host is the device, so reading the
    flag waits for nothing (every other device takes the branch-free path).
    """
    if grads[0].dtype == torch.float64:
        return _norms(grads, norm_type, torch.float64)
    fast = _norms(grads, norm_type, torch.float32)
    if bool(torch.isfinite(fast).all()):
        return fast
    return _norms(grads, norm_type, torch.float64)


def _norms(grads: list[Tensor], norm_type: float, dtype: torch.dtype) -> Tensor:
    """Each gradient's norm, accumulated in ``dtype``, stacked."""
    return torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in grads])


def _narrow_on_cpu(grad: Tensor, norm_type: float) -> bool:
    """Whether :meth:`NonFiniteGradGuard._clip_on_cpu` applies: gradients on the CPU
    narrower than float64, and a p-norm with 1 <= p <= 2: a non-finite gradient
    gives a non-finite total (no element can hide in the sum), and the total is
    float64, so the coefficient taken as a Python float is the very number the
    tensor path computes (above 2 the total is float32, computed scaled)."""
    return grad.device.type == "cpu" and grad.dtype != torch.float64 and 1 <= norm_type <= 2


def _scale(groups: list[list[Tensor]], total: Tensor, max_norm: float) -> None:
    """Multiply the gradients by torch's coefficient, ``max_norm / (total + 1e-6)``
    clamped at 1, on each group's own device and in its dtype (no host sync)."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in groups:
        torch._foreach_mul_(grads, coef.to(device=grads[0].device, dtype=grads[0].dtype))


def _combine(norms: Tensor, norm_type: float, *, wide: bool = True) -> Tensor:
    """The norm of per-tensor norms, in float64.

    Norms of float32 or narrower gradients (``wide`` False) are at most
    ~3.4e38 times the square root of an element count, so the float64 sum of
    their squares cannot overflow (for ``norm_type`` <= 2): one reduction.
    Otherwise they are scaled by their maximum first so the sum cannot overflow.
    """
    if math.isinf(norm_type):
        return norms.max()
    if not wide and norm_type <= 2:
        summed: Tensor = torch.linalg.vector_norm(norms, norm_type, dtype=torch.float64)
        return summed
    scale = norms.max()
    ok = (scale > 0) & torch.isfinite(scale)
    safe = torch.where(ok, scale, torch.ones_like(scale))
    # a non-finite (or zero) maximum is the answer itself, as in torch: inf stays inf
    total: Tensor = torch.where(ok, safe * torch.linalg.vector_norm(norms / safe, norm_type), scale)
    return total
