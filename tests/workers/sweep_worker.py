"""Rank side of tests/collectives/test_collectives_properties.py: safe_all_reduce against dist.all_reduce on
cases drawn by hypothesis.

Every rank draws the cases itself, with hypothesis derandomized (its seed comes from this
function's identity), the generate phase only (no shrinking, which would depend on outcomes) and
no example database; the body only records each case, so nothing rank-specific can steer the
generation. The ranks then compare a digest of their lists before any case runs. Values are small
integers, so every sum, product and mean is exact in every dtype and order: equality is bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rankkit import put

from ncclguard import safe_all_reduce

MAX_EXAMPLES = 400
R = dist.ReduceOp
DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
OPS = {
    "SUM": R.SUM,
    "PRODUCT": R.PRODUCT,
    "MIN": R.MIN,
    "MAX": R.MAX,
    "AVG": R.AVG,
    "BAND": R.BAND,
    "BOR": R.BOR,
    "BXOR": R.BXOR,
}
FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def view_of(base: torch.Tensor, ops: list[int]) -> torch.Tensor:
    """A view of ``base`` made by a sequence of view operations, each chosen and shaped by an int."""
    t = base
    for code in ops:
        kind, arg = code % 4, code // 4
        if t.dim() == 0:
            break
        d = arg % t.dim()
        if kind == 0 and t.dim() >= 2:
            t = t.transpose(d, (d + 1 + arg // 7) % t.dim())
        elif kind == 1:  # every 2nd or 3rd element along d (never all of them dropped)
            start = arg % 2 if t.shape[d] > 1 else 0
            t = t[(slice(None),) * d + (slice(start, None, 2 + arg % 2),)]
        elif kind == 2 and t.dim() >= 2:
            perm = list(range(t.dim()))
            perm = perm[arg % t.dim() :] + perm[: arg % t.dim()]
            t = t.permute(*perm)
        elif kind == 3 and t.shape[d] > 0:
            start = arg % t.shape[d]
            t = t.narrow(d, start, (arg // 3) % (t.shape[d] - start) + 1)
    return t


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    floating = DTYPES[dtype].is_floating_point
    shape = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    # Now and then a 0-d or an empty tensor (middle values: hypothesis favours the ends of a range).
    rare = draw(st.integers(0, 15))
    if rare == 7:
        shape = []
    elif rare == 8:
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    return {
        "dtype": dtype,
        "op": draw(st.sampled_from(FLOAT_OPS if floating else INT_OPS)),
        "shape": shape,
        "view_ops": draw(st.lists(st.integers(0, 10_000), min_size=1, max_size=4)),
        "chunks": draw(st.one_of(st.none(), st.integers(1, 40))),
        "atomic": draw(st.booleans()),
        "verify": draw(st.sampled_from([None, True, False])),
    }


def draw_cases() -> list[dict[str, Any]]:
    drawn: list[dict[str, Any]] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(case=cases())
    def collect(case: dict[str, Any]) -> None:
        drawn.append(case)

    collect()
    return drawn


def values(shape: list[int], dtype: torch.dtype, rank: int, salt: int) -> torch.Tensor:
    n = math.prod(shape)
    raw = (torch.arange(n, dtype=torch.int64) * (rank + 2) + salt) % 7
    if dtype == torch.bool:
        raw = raw % 2
    elif dtype == torch.uint8:
        raw = raw % 4
    else:
        raw = raw - 3
    return raw.reshape(shape).to(dtype)


def _digest(drawn: list[dict[str, Any]]) -> torch.Tensor:
    digest = hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).digest()
    return torch.tensor([int.from_bytes(digest[:7], "big")], dtype=torch.int64)


def main() -> None:
    r = rankkit.init()
    world = dist.get_world_size()
    drawn = draw_cases()
    lo, hi = _digest(drawn), _digest(drawn)
    dist.all_reduce(lo, op=R.MIN)
    dist.all_reduce(hi, op=R.MAX)
    same = bool(lo.item() == hi.item())
    put("cases", len(drawn))
    put("same_cases_on_every_rank", same)
    if not same:
        rankkit.done()

    mismatches, failed = [], []
    seen: dict[str, Any] = {"dtype": [], "op": [], "non_contiguous": 0, "chunked": 0, "atomic": 0, "empty_or_0d": 0}
    for i, case in enumerate(drawn):
        dtype, op = DTYPES[case["dtype"]], OPS[case["op"]]
        base = values(case["shape"], dtype, r, i)
        view = view_of(base, case["view_ops"])
        n = view.numel()
        chunk = math.ceil(n / case["chunks"]) if case["chunks"] and n else None
        want = view.contiguous().clone()
        if case["op"] == "AVG":  # gloo has no AVG: the reference is SUM / world
            dist.all_reduce(want, op=R.SUM)
            want = want / world
        else:
            dist.all_reduce(want, op=op)
        outside = base.clone()
        res = safe_all_reduce(view, op=op, chunk_numel=chunk, atomic=case["atomic"], verify=case["verify"], timeout=20)
        if not res:
            failed.append(f"case {i} {case}: {res.error}")
            continue
        # The view holds the reduced values; every element of the base outside the view is untouched.
        touched = torch.zeros(base.numel(), dtype=torch.bool)
        view_of(touched.view(base.shape), case["view_ops"]).fill_(True)
        untouched = ~touched.view(base.shape)
        if not (torch.equal(view.contiguous(), want) and torch.equal(base[untouched], outside[untouched])):
            mismatches.append(f"case {i} {case}: got {view.tolist()} want {want.tolist()}")
        seen["dtype"].append(case["dtype"])
        seen["op"].append(case["op"])
        seen["non_contiguous"] += int(not view.is_contiguous())
        seen["chunked"] += int(res.chunks > 1)
        seen["atomic"] += int(case["atomic"])
        seen["empty_or_0d"] += int(n == 0 or view.dim() == 0)
    seen["dtype"], seen["op"] = sorted(set(seen["dtype"])), sorted(set(seen["op"]))
    put("mismatches", mismatches[:20])
    put("failed_calls", failed[:20])
    put("seen", seen)
    rankkit.done()


if __name__ == "__main__":
    main()
