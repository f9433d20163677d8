"""NonFiniteGradGuard: device-side accumulation, overflow-safe clipping, naming the culprits."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from ckptdb import NonFiniteGradGuard

NAN, INF = float("nan"), float("inf")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def params_with_grads(
    *grads: list[float] | Tensor | None, dtype: torch.dtype = torch.float32
) -> list[nn.Parameter]:
    """One parameter per entry, its .grad set to the values given (None: no grad)."""
    out = []
    for g in grads:
        if g is None:
            p = nn.Parameter(torch.zeros(3, dtype=dtype))
        else:
            value = g if isinstance(g, Tensor) else torch.tensor(g, dtype=dtype)
            p = nn.Parameter(torch.zeros_like(value))
            p.grad = value.clone()
        out.append(p)
    return out


def random_params(seed: int, scale: float = 1.0, device: str = "cpu") -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3,), (2, 2, 2), (1,), (7,)]
    grads = [(torch.randn(s, generator=gen) * scale).to(device) for s in shapes]
    return params_with_grads(*grads)


def clones(params: list[nn.Parameter]) -> list[nn.Parameter]:
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    return model


def poison(model: nn.Module, name: str, value: float) -> None:
    grad = dict(model.named_parameters())[name].grad
    assert grad is not None
    grad.view(-1)[0] = value


# --------------------------------------------------------------------------- update / tripped


def test_fresh_guard_is_not_tripped() -> None:
    guard = NonFiniteGradGuard()
    assert guard.tripped() is False
    assert guard.nonfinite_parameters() == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("value", "bad"),
    [
        (0.0, False),
        (1.5, False),
        (-3.0, False),
        (1e4, False),
        (NAN, True),
        (INF, True),
        (-INF, True),
    ],
)
def test_update_with_tensor(device: str, dtype: torch.dtype, value: float, bad: bool) -> None:
    guard = NonFiniteGradGuard()
    guard.update(torch.tensor(value, dtype=dtype, device=device))
    result = guard.tripped()
    assert type(result) is bool
    assert result is bad


@pytest.mark.parametrize(
    ("value", "bad"),
    [
        (0.0, False),
        (2.5, False),
        (1e308, False),
        (3, False),
        (NAN, True),
        (INF, True),
        (-INF, True),
    ],
)
def test_update_with_python_number(value: float, bad: bool) -> None:
    guard = NonFiniteGradGuard()
    guard.update(value)
    result = guard.tripped()
    assert type(result) is bool
    assert result is bad


@pytest.mark.parametrize(
    ("values", "bad"),
    [([1.0, 2.0, 3.0], False), ([1.0, NAN, 3.0], True), ([INF, 0.0], True), ([], False)],
)
def test_update_with_multi_element_tensor(values: list[float], bad: bool) -> None:
    guard = NonFiniteGradGuard()
    guard.update(torch.tensor(values))
    assert guard.tripped() is bad


def test_float32_max_is_finite() -> None:
    guard = NonFiniteGradGuard()
    guard.update(torch.tensor(torch.finfo(torch.float32).max))
    assert guard.tripped() is False


@pytest.mark.parametrize("as_tensor", [True, False])
@pytest.mark.parametrize("bad_at", [0, 2, 4])
def test_non_finite_is_remembered_until_reset(as_tensor: bool, bad_at: int) -> None:
    guard = NonFiniteGradGuard()
    for i in range(6):
        value = NAN if i == bad_at else 1.0 + i
        guard.update(torch.tensor(value) if as_tensor else value)
        assert guard.tripped() is (i >= bad_at)
    assert guard.tripped() is True  # reading the flag does not clear it
    guard.reset()
    assert guard.tripped() is False
    guard.update(torch.tensor(1.0) if as_tensor else 1.0)
    assert guard.tripped() is False
    guard.update(torch.tensor(INF) if as_tensor else INF)
    assert guard.tripped() is True


def test_python_and_tensor_updates_accumulate_together() -> None:
    guard = NonFiniteGradGuard()
    guard.update(NAN)
    guard.update(torch.tensor(1.0))
    assert guard.tripped() is True
    guard.reset()
    guard.update(torch.tensor(NAN))
    guard.update(1.0)
    assert guard.tripped() is True
    guard.reset()
    assert guard.tripped() is False


@pytest.mark.parametrize("device", DEVICES)
def test_flag_stays_a_tensor_on_the_norms_device(device: str) -> None:
    guard = NonFiniteGradGuard()
    for value in (1.0, NAN, 2.0):
        guard.update(torch.tensor(value, device=device))
    flags = list(guard._flags.values())
    assert len(flags) == 1
    assert all(isinstance(f, Tensor) for f in flags)
    assert flags[0].device.type == torch.device(device).type
    assert guard.tripped() is True


def test_flag_lives_on_the_norms_device_even_without_data() -> None:
    # a meta tensor has no data, so any host read would fail: update must stay on device
    guard = NonFiniteGradGuard()
    guard.update(torch.tensor(NAN, device="meta"))
    flags = list(guard._flags.items())
    assert len(flags) == 1
    device, flag = flags[0]
    assert isinstance(flag, Tensor)
    assert device.type == "meta"
    assert flag.device.type == "meta"


def test_update_keeps_one_flag_per_device() -> None:
    guard = NonFiniteGradGuard()
    guard.update(torch.tensor(1.0))
    guard.update(torch.tensor(2.0, device="meta"))
    assert {d.type for d in guard._flags} == {"cpu", "meta"}


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Make every Tensor -> Python conversion raise while the test body runs."""
    calls: list[str] = []

    def forbid(name: str):  # type: ignore[no-untyped-def]
        def raiser(self: Tensor, *args: object, **kwargs: object) -> None:
            calls.append(name)
            raise AssertionError(f"host sync: Tensor.{name} called")

        return raiser

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            patch.setattr(Tensor, name, forbid(name))
        yield calls


def test_update_does_not_sync(no_host_sync: list[str]) -> None:
    guard = NonFiniteGradGuard()
    for value in (1.0, NAN, 3.0, INF):
        guard.update(torch.tensor(value))
    assert no_host_sync == []
    assert isinstance(guard._flags[torch.device("cpu")], Tensor)


def meta_params() -> list[nn.Parameter]:
    """Parameters and gradients with no data at all: reading any value back fails."""
    out = []
    for shape in ((4, 3), (3,), (2, 2, 2)):
        p = nn.Parameter(torch.empty(shape, device="meta"))
        p.grad = torch.empty(shape, device="meta")
        out.append(p)
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
def test_clip_grad_norm_does_not_sync(no_host_sync: list[str], norm_type: float) -> None:
    """Off the CPU the guard takes the branch-free path: nothing is read back (on the
    meta device any read would fail too). The CPU's one read is the next test's."""
    params = meta_params()
    guard = NonFiniteGradGuard()
    for _ in range(3):
        total = guard.clip_grad_norm_(params, 0.1, norm_type=norm_type)
        assert isinstance(total, Tensor) and total.device.type == "meta"
    assert no_host_sync == []
    assert all(flags.device.type == "meta" for _, flags in guard._param_flags.values())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
def test_on_the_cpu_clip_reads_back_one_flag_per_step(
    monkeypatch: pytest.MonkeyPatch, norm_type: float
) -> None:
    """The host is the device on the CPU: the float32 fast path reads back its total
    norm (one value per step), and nothing else, also on the step that falls back
    to float64 because a gradient is not finite."""
    calls: list[str] = []
    model = small_model()
    guard = NonFiniteGradGuard(model)
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            real = getattr(Tensor, name)

            def record(self: Tensor, *a: object, _n: str = name, _r: object = real) -> object:
                calls.append(_n)
                return _r(self, *a)  # type: ignore[operator]

            patch.setattr(Tensor, name, record)
        for _ in range(3):
            guard.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type)
        poison(model, "0.weight", NAN)
        guard.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type)
    assert calls == ([] if math.isinf(norm_type) else ["item"] * 4)
    assert guard.tripped() and guard.nonfinite_parameters() == ["0.weight"]


def test_tripped_after_unsynced_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    guard = NonFiniteGradGuard()
    model = small_model()
    guard.clip_grad_norm_(model.parameters(), 1.0)  # on the CPU it reads its total (above)
    with monkeypatch.context() as patch:
        patch.setattr(Tensor, "item", lambda self: pytest.fail("item() during update"))
        guard.update(torch.tensor(NAN))
    assert guard.tripped() is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to detect device syncs")
def test_no_cuda_sync_in_update_and_clip() -> None:
    model = small_model().cuda()
    guard = NonFiniteGradGuard(model)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        guard.update(torch.tensor(NAN, device="cuda"))
        guard.clip_grad_norm_(model.parameters(), 0.5)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert guard.tripped() is True
    assert next(iter(guard._flags)).type == "cuda"


# --------------------------------------------------------------------------- clip vs torch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, 2, 1.0, INF, 3.0])
@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e6])
@pytest.mark.parametrize("seed", [0, 1])
def test_clip_matches_torch(device: str, norm_type: float, max_norm: float, seed: int) -> None:
    ours, theirs = random_params(seed, device=device), random_params(seed, device=device)
    guard = NonFiniteGradGuard()
    total = guard.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    torch.testing.assert_close(total, expected)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert guard.tripped() is False


def test_clip_runs_outside_autograd_like_torch() -> None:
    """Gradients taken with ``create_graph=True`` carry a graph of their own; torch's
    clipping runs under ``no_grad``, so neither the total nor the scaling joins it."""

    def graphed() -> list[nn.Parameter]:
        params = random_params(0)
        for p in params:
            p.grad = None
        loss = sum((p**3).sum() for p in params)
        assert isinstance(loss, Tensor)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        assert all(p.grad is not None and p.grad.grad_fn is not None for p in params)
        return params

    ours, theirs = graphed(), graphed()
    total = NonFiniteGradGuard().clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert total.grad_fn is None and expected.grad_fn is None
    torch.testing.assert_close(total, expected)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("norm_type", [1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("max_norm", [math.inf, NAN, 0.0, -1.0])
def test_clip_matches_torch_at_odd_limits(max_norm: float, norm_type: float) -> None:
    """torch clamps the coefficient at 1 and multiplies by it whatever it is: an
    infinite limit changes nothing, a NaN one makes every gradient NaN, zero zeroes
    them, a negative one flips them; the CPU path (a coefficient read as a
    number, its multiplication skipped at 1) must do the same."""
    ours, theirs = random_params(0), random_params(0)
    total = NonFiniteGradGuard().clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, expected)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)


@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
def test_clip_below_and_above_the_norm(max_norm: float) -> None:
    params = random_params(3)
    before = [p.grad.clone() for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]).double())
    total = NonFiniteGradGuard().clip_grad_norm_(params, max_norm)
    torch.testing.assert_close(total.double(), norm, rtol=1e-6, atol=0)
    after = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).double()
    if max_norm > norm:  # above the norm: untouched
        for p, g in zip(params, before, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    else:  # below: rescaled to max_norm, same direction
        torch.testing.assert_close(torch.linalg.vector_norm(after), torch.tensor(max_norm).double())
        for p, g in zip(params, before, strict=True):
            torch.testing.assert_close(p.grad, g * (max_norm / norm.item()))


def test_clip_ignores_params_without_grad() -> None:
    base = random_params(4)
    base[1].grad = None
    base[3].grad = None
    ours, theirs = clones(base), clones(base)
    guard = NonFiniteGradGuard()
    total = guard.clip_grad_norm_(ours, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    torch.testing.assert_close(total, expected)
    for p, q in zip(ours, theirs, strict=True):
        if q.grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad)
    assert guard.tripped() is False


@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_single_tensor(max_norm: float) -> None:
    (ours,), (theirs,) = random_params(5)[:1], random_params(5)[:1]
    total = NonFiniteGradGuard().clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(ours.grad, theirs.grad)


def test_clip_accepts_a_generator() -> None:
    ours, theirs = small_model(), small_model()
    total = NonFiniteGradGuard(ours).clip_grad_norm_(ours.parameters(), 0.05)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    torch.testing.assert_close(total, expected)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clip_returns_norm_in_grad_dtype(dtype: torch.dtype) -> None:
    params = params_with_grads([3.0, 4.0], dtype=dtype)
    total = NonFiniteGradGuard().clip_grad_norm_(params, 1.0)
    assert total.dtype == dtype
    torch.testing.assert_close(total, torch.tensor(5.0, dtype=dtype))
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.8], dtype=dtype))


@pytest.mark.parametrize("params", [[], "no_grads"])
def test_clip_with_nothing_to_clip_returns_zero(params: object) -> None:
    if params == "no_grads":
        params = params_with_grads(None, None)
    guard = NonFiniteGradGuard()
    total = guard.clip_grad_norm_(params, 1.0)  # type: ignore[arg-type]
    assert isinstance(total, Tensor)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_([], 1.0))
    assert total.item() == 0.0
    assert guard.tripped() is False
    assert guard.nonfinite_parameters() == []


# --------------------------------------------------------------------------- overflow safety


OVERFLOW_CASES = {
    # float32 sum of squares overflows although the norm itself is representable
    "ten_1e30": [[1e30] * 10],
    "split_1e30": [[1e30] * 5, [1e30] * 5, [-1e30] * 3],
    "3e38_in_one_tensor": [[3e38, 1e38]],
    "3e38_across_tensors": [[3e38], [1e38]],
    "3e38_with_small": [[3e38], [1.0, -2.0, 1e-30]],
}


@pytest.mark.parametrize("max_norm", [1.0, 5.0])
@pytest.mark.parametrize("case", sorted(OVERFLOW_CASES))
def test_clip_is_overflow_safe(case: str, max_norm: float) -> None:
    values = OVERFLOW_CASES[case]
    grads = [torch.tensor(v, dtype=torch.float32) for v in values]
    exact = torch.linalg.vector_norm(torch.cat(grads).double())  # float64 reference
    assert math.isfinite(exact.item())
    assert exact.item() <= torch.finfo(torch.float32).max

    # torch's own clip overflows to inf on these
    theirs = params_with_grads(*grads)
    assert torch.isinf(torch.nn.utils.clip_grad_norm_(theirs, max_norm))

    guard = NonFiniteGradGuard()
    ours = params_with_grads(*grads)
    total = guard.clip_grad_norm_(ours, max_norm)
    assert torch.isfinite(total)
    torch.testing.assert_close(total.double(), exact, rtol=1e-6, atol=0)
    assert guard.tripped() is False
    assert guard.nonfinite_parameters() == []

    clipped = [p.grad for p in ours if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in clipped)
    flat = torch.cat([g.flatten() for g in clipped]).double()
    torch.testing.assert_close(
        torch.linalg.vector_norm(flat), torch.tensor(max_norm).double(), rtol=1e-4, atol=0
    )
    # the direction is kept: each clipped gradient is the original times max_norm / norm
    for g, orig in zip(clipped, grads, strict=True):
        torch.testing.assert_close(
            g.double(), orig.double() * (max_norm / exact), rtol=1e-4, atol=1e-30
        )


def norm_dtypes(monkeypatch: pytest.MonkeyPatch, grads: list[Tensor]) -> list[object]:
    """Record the accumulation dtype of every vector_norm taken of one of ``grads``."""
    seen: list[object] = []
    real = torch.linalg.vector_norm
    ids = {id(g) for g in grads}

    def spy(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if id(x) in ids:
            seen.append(kwargs.get("dtype"))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", spy)
    return seen


def test_cpu_norms_are_float32_until_one_overflows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path: float32 norms, no float64 pass while every norm is finite. The
    fallback: the group is recomputed in float64 when a float32 sum of squares
    overflows, and then gives the exact norm, without tripping."""
    calm = params_with_grads([1.0, -2.0, 3.0], [0.5])
    seen = norm_dtypes(monkeypatch, [p.grad for p in calm if p.grad is not None])
    guard = NonFiniteGradGuard()
    total = guard.clip_grad_norm_(calm, 100.0)
    assert seen == [torch.float32, torch.float32]
    torch.testing.assert_close(total, torch.tensor(math.sqrt(14.25)))

    huge = params_with_grads([1e30] * 10, [0.5])
    seen = norm_dtypes(monkeypatch, [p.grad for p in huge if p.grad is not None])
    total = guard.clip_grad_norm_(huge, 1.0)
    assert seen == [torch.float32, torch.float32, torch.float64, torch.float64]
    exact = math.sqrt(10 * 1e60 + 0.25)
    torch.testing.assert_close(total.double(), torch.tensor(exact).double(), rtol=1e-6, atol=0)
    assert guard.tripped() is False and guard.nonfinite_parameters() == []


def test_the_fallback_still_names_a_non_finite_gradient_next_to_an_overflow() -> None:
    """A NaN sends its group down the float64 path too; that path must still flag
    the NaN, and only it: the overflowing neighbour is finite."""
    guard = NonFiniteGradGuard()
    params = params_with_grads([3e38, 3e38], [NAN, 1.0], [2.0])
    total = guard.clip_grad_norm_(params, 1.0)
    assert torch.isnan(total)
    assert guard.tripped() is True
    assert guard.nonfinite_parameters() == ["param[1](2,)"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(OVERFLOW_CASES))
def test_clip_is_overflow_safe_on_cuda_without_a_sync(case: str) -> None:
    grads = [torch.tensor(v, dtype=torch.float32, device="cuda") for v in OVERFLOW_CASES[case]]
    exact = torch.linalg.vector_norm(torch.cat(grads).double())
    params = params_with_grads(*grads)
    guard = NonFiniteGradGuard()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total = guard.clip_grad_norm_(params, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.testing.assert_close(total.double(), exact, rtol=1e-6, atol=0)
    assert guard.tripped() is False


def test_huge_but_unrepresentable_norm_does_not_trip() -> None:
    # the norm (4.2e38) exceeds float32, but every gradient is finite: no false alarm
    guard = NonFiniteGradGuard()
    params = params_with_grads([3e38, 3e38])
    guard.clip_grad_norm_(params, 1.0)
    assert guard.tripped() is False
    grad = params[0].grad
    assert grad is not None and torch.isfinite(grad).all()
    torch.testing.assert_close(
        torch.linalg.vector_norm(grad.double()), torch.tensor(1.0).double(), rtol=1e-4, atol=0
    )


# --------------------------------------------------------------------------- non-finite gradients


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("name", ["0.weight", "0.bias", "2.weight", "2.bias"])
def test_non_finite_grad_trips_and_names_the_parameter(
    name: str, bad: float, norm_type: float
) -> None:
    model = small_model()
    guard = NonFiniteGradGuard(model)
    poison(model, name, bad)
    total = guard.clip_grad_norm_(model.parameters(), 1.0, norm_type=norm_type)
    assert not torch.isfinite(total)
    assert guard.tripped() is True
    assert guard.nonfinite_parameters() == [name]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_total_norm_matches_torch(bad: float, norm_type: float) -> None:
    base = params_with_grads([1.0, 2.0], [bad, 3.0], [4.0])
    total = NonFiniteGradGuard().clip_grad_norm_(clones(base), 1.0, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(clones(base), 1.0, norm_type=norm_type)
    torch.testing.assert_close(total, expected, equal_nan=True)


def test_names_from_named_parameters() -> None:
    model = small_model()
    guard = NonFiniteGradGuard(list(model.named_parameters()))
    poison(model, "2.bias", NAN)
    guard.clip_grad_norm_(model.parameters(), 1.0)
    assert guard.tripped() is True
    assert guard.nonfinite_parameters() == ["2.bias"]


def test_names_every_offending_parameter() -> None:
    model = small_model()
    guard = NonFiniteGradGuard(model)
    poison(model, "0.weight", NAN)
    poison(model, "2.bias", INF)
    guard.clip_grad_norm_(model.parameters(), 1.0)
    assert sorted(guard.nonfinite_parameters()) == ["0.weight", "2.bias"]


@pytest.mark.parametrize("position", [0, 1, 2])
def test_unnamed_parameters_are_named_by_position(position: int) -> None:
    grads: list[list[float] | None] = [[1.0, 2.0, 3.0] for _ in range(3)]
    grads[position] = [1.0, NAN, 3.0]
    guard = NonFiniteGradGuard()
    guard.clip_grad_norm_(params_with_grads(*grads), 1.0)
    assert guard.tripped() is True
    (name,) = guard.nonfinite_parameters()
    assert f"[{position}]" in name
    others = {f"[{i}]" for i in range(3)} - {f"[{position}]"}
    assert not any(o in name for o in others)


def test_position_counts_parameters_without_grad() -> None:
    # the position is the one in the list the caller passed
    guard = NonFiniteGradGuard()
    guard.clip_grad_norm_(params_with_grads(None, [NAN, 1.0, 1.0]), 1.0)
    (name,) = guard.nonfinite_parameters()
    assert "[1]" in name
    assert "[0]" not in name


def test_position_is_global_across_dtypes() -> None:
    a = params_with_grads([1.0, 2.0, 3.0])[0]
    b = params_with_grads([INF, 1.0, 1.0], dtype=torch.float64)[0]
    guard = NonFiniteGradGuard()
    guard.clip_grad_norm_([a, b], 1.0)
    assert guard.tripped() is True
    (name,) = guard.nonfinite_parameters()
    assert "[1]" in name
    assert "[0]" not in name


def test_unknown_parameters_of_a_named_guard_still_reported() -> None:
    model = small_model()
    guard = NonFiniteGradGuard(model)
    (stray,) = params_with_grads([NAN, 0.0, 0.0])
    guard.clip_grad_norm_([*model.parameters(), stray], 1.0)
    assert guard.tripped() is True
    names = guard.nonfinite_parameters()
    assert len(names) == 1
    assert names[0] not in dict(model.named_parameters())


def test_accumulates_over_steps_until_reset() -> None:
    model = small_model()
    guard = NonFiniteGradGuard(model)
    clean = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    poison(model, "0.weight", NAN)  # step 1: bad
    guard.clip_grad_norm_(model.parameters(), 1.0)
    for n, p in model.named_parameters():  # step 2: finite again
        p.grad = clean[n].clone()
    total = guard.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isfinite(total)
    assert guard.tripped() is True
    assert guard.nonfinite_parameters() == ["0.weight"]

    poison(model, "2.bias", INF)  # step 3: another one goes bad
    guard.clip_grad_norm_(model.parameters(), 1.0)
    assert sorted(guard.nonfinite_parameters()) == ["0.weight", "2.bias"]

    guard.reset()
    assert guard.tripped() is False
    assert guard.nonfinite_parameters() == []
    for n, p in model.named_parameters():
        p.grad = clean[n].clone()
    guard.clip_grad_norm_(model.parameters(), 1.0)
    assert guard.tripped() is False
    assert guard.nonfinite_parameters() == []


def test_finite_grads_name_nothing() -> None:
    model = small_model()
    guard = NonFiniteGradGuard(model)
    for _ in range(3):
        guard.clip_grad_norm_(model.parameters(), 1e-3)
    assert guard.tripped() is False
    assert guard.nonfinite_parameters() == []


# ------------------------------------------------------------------ observe


@pytest.mark.parametrize(
    "bad, trips",
    [
        (float("nan"), True),
        (float("inf"), True),
        (-float("inf"), True),
        (3e38, False),  # finite, though its square would overflow float32
        (-1e30, False),
    ],
)
def test_observe_trips_exactly_on_non_finite_gradients(bad: float, trips: bool) -> None:
    model = torch.nn.Linear(3, 2)
    guard = NonFiniteGradGuard(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert model.weight.grad is not None
    model.weight.grad[1, 2] = bad
    before = model.weight.grad.clone()
    guard.observe(model.parameters())
    assert guard.tripped() is trips
    assert guard.nonfinite_parameters() == (["weight"] if trips else [])
    assert torch.equal(model.weight.grad.nan_to_num(), before.nan_to_num())  # unchanged


def test_observe_of_a_half_precision_gradient_near_its_limit_does_not_trip() -> None:
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    p.grad = torch.full((8,), 65000.0, dtype=torch.float16)
    guard = NonFiniteGradGuard([("p", p)])
    guard.observe([p])
    assert not guard.tripped()


def test_observe_ignores_a_step_the_scaler_skips() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    guard = NonFiniteGradGuard([("p", p)])
    guard.observe([p], skipped=torch.tensor(True))
    assert not guard.tripped()
    guard.observe([p], skipped=torch.tensor(False))
    assert guard.tripped() and guard.nonfinite_parameters() == ["p"]


def test_observe_without_gradients_records_nothing() -> None:
    guard = NonFiniteGradGuard()
    guard.observe([torch.nn.Parameter(torch.zeros(2))])
    assert not guard.tripped()
