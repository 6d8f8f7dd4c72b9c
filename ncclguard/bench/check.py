"""The correctness pass: integer-valued data whose reduction is exact in every dtype, and its count of wrong values.

Rank ``r`` holds ``1 + (i + r) % 2`` at element ``i`` (values 1 and 2). Sums stay small integers,
products are powers of two and min/max are 1 or 2, so every dtype represents the result
exactly whatever order the backend reduces in (as nccl-tests' check intends). The expected
result depends only on ``i % 2``: two numbers, no reference tensor.

Test hook: the corrupted rank sends 3 everywhere (0 for ``min``), which changes every element
of the result for every op, so ``#wrong`` equals the element count.
"""

from __future__ import annotations

import torch

from ncclguard.bench.memory import CHECK_BLOCK

__all__ = ["fill", "expected", "count_wrong"]


def _value(index_parity: int, rank: int) -> int:
    return 1 + (index_parity + rank) % 2


def fill(t: torch.Tensor, rank: int, corrupt: bool = False, op: str = "sum") -> None:
    """Writes this rank's contribution into ``t`` (contiguous), or the corrupted one."""
    flat = t.view(-1)
    if corrupt:
        flat.fill_(0 if op == "min" else 3)
        return
    flat[0::2].fill_(_value(0, rank))
    flat[1::2].fill_(_value(1, rank))


def expected(op: str, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduced values at even and at odd indices, as the backend computes them in ``dtype``."""
    out = []
    for parity in (0, 1):
        values = [_value(parity, r) for r in range(world)]
        if op == "avg":
            out.append(torch.tensor(sum(values), dtype=torch.float64).div(world).to(dtype))
            continue
        if op == "sum":
            v = sum(values)
        elif op == "prod":
            v = 1
            for x in values:
                v *= x
        elif op == "min":
            v = min(values)
        elif op == "max":
            v = max(values)
        else:
            raise ValueError(f"unknown op {op!r}; use one of sum, prod, min, max, avg")
        if not (dtype.is_floating_point or dtype.is_complex):
            # Exact Python integer, wrapped to the dtype's width as the backend's arithmetic wraps.
            bits = torch.iinfo(dtype).bits
            v %= 1 << bits
            if torch.iinfo(dtype).min < 0 and v >= 1 << (bits - 1):
                v -= 1 << bits
        out.append(
            torch.tensor(v, dtype=dtype)
            if not dtype.is_floating_point
            else torch.tensor(float(v), dtype=torch.float64).to(dtype)
        )
    return out[0], out[1]


def count_wrong(t: torch.Tensor, op: str, world: int) -> int:
    """Elements of the reduced ``t`` that differ from the expected result.

    Exact comparison, except ``avg`` (a division) which allows a few units in the last place.
    Works through ``t`` in blocks so the pass needs little memory beyond the tensor.
    """
    even, odd = expected(op, world, t.dtype)
    flat = t.view(-1)
    tol = 4 * torch.finfo(t.dtype).eps if op == "avg" else 0.0
    wrong = 0
    for a in range(0, flat.numel(), CHECK_BLOCK):  # CHECK_BLOCK is even, so parity is kept
        block = flat[a : a + CHECK_BLOCK]
        for part, want in ((block[0::2], even), (block[1::2], odd)):
            if tol:
                bad = ~torch.isclose(part, want.to(part.device).expand_as(part), rtol=tol, atol=0.0)
            else:
                bad = part != want.to(part.device)
            wrong += int(bad.sum().item())
    return wrong
