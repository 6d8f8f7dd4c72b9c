"""Rank side of tests/collectives/test_collectives_multirank.py. Usage: collectives_worker.py SCENARIO."""

from __future__ import annotations

import sys
import time

import rankkit
import torch
import torch.distributed as dist
from rankkit import leave, put, stall

from ncclguard import safe_all_reduce, safe_barrier
from ncclguard.errors import CollectiveError, CollectiveMismatch
from ncclguard.recording.flight import recorder

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "MIN": R.MIN, "MAX": R.MAX, "PRODUCT": R.PRODUCT, "AVG": R.AVG}
DTYPES = {"int64": torch.int64, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def data(shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    # Small integers: every sum and product is exact, so any summation order gives the same bits.
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) * (rank + 2)) % 7 - 3).reshape(shape).to(dtype)


def expected(x: torch.Tensor, op_name: str, world: int) -> torch.Tensor:
    ref = x.clone()
    if op_name == "AVG":  # gloo has no AVG: the reference is SUM / world
        dist.all_reduce(ref, op=R.SUM)
        return ref / world
    dist.all_reduce(ref, op=OPS[op_name])
    return ref


def semantics() -> None:
    r = rankkit.init()
    world = dist.get_world_size()
    mismatches = []
    count = 0
    for op_name in OPS:
        for dt_name, dt in DTYPES.items():
            if op_name == "AVG" and not dt.is_floating_point:
                continue
            cases = {
                "0d": lambda dt=dt: data((), dt, r),
                "empty": lambda dt=dt: data((0,), dt, r),
                "vector": lambda dt=dt: data((37,), dt, r),
                "noncontig": lambda dt=dt: data((6, 9), dt, r).t(),
                "chunked": lambda dt=dt: data((50,), dt, r),
                "chunked_noncontig": lambda dt=dt: data((10, 12), dt, r)[:, ::2],
            }
            for case, make in cases.items():
                want = expected(make(), op_name, world)
                got = make()
                chunk = 7 if case.startswith("chunked") else None
                res = safe_all_reduce(got, op=OPS[op_name], chunk_numel=chunk, timeout=20)
                count += 1
                same = bool(res) and got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
                if not same:
                    mismatches.append(f"{op_name}/{dt_name}/{case}: ok={res.ok} err={res.error} got={got} want={want}")
                if "noncontig" in case and got.is_contiguous():
                    mismatches.append(f"{op_name}/{dt_name}/{case}: test did not exercise a non-contiguous tensor")
    put("equality_cases", count)
    put("equality_mismatches", mismatches)

    # int64 beyond float precision: bit-exact.
    big = torch.full((5,), 2**53 + 1 + r, dtype=torch.int64)
    ref = big.clone()
    dist.all_reduce(ref)
    safe_all_reduce(big, timeout=20).raise_for_error()
    put("int64_exact", torch.equal(big, ref))

    # The chunked path with policy and result fields.
    x = torch.ones(100, dtype=torch.float32)
    res = safe_all_reduce(x, chunk_numel=30, timeout=20, verify=True)
    put(
        "chunked_fields",
        {
            "ok": res.ok,
            "chunks": res.chunks,
            "numel": res.numel,
            "nbytes": res.nbytes,
            "reduced_numel": res.reduced_numel,
            "value": x[0].item(),
            "bool": bool(res),
        },
    )

    # A rank passes a different numel: every rank refuses, nothing changes.
    if r == 1:
        rankkit.fault_fired("a different numel")
    n = 12 if r == 1 else 10
    before = torch.arange(n, dtype=torch.float32)
    t = before.clone()
    res = safe_all_reduce(t, verify=True, timeout=20)
    put(
        "mismatch",
        {
            "ok": res.ok,
            "type": type(res.error).__name__,
            "unchanged": torch.equal(t, before),
            "fingerprint_ranks": sorted(res.error.fingerprints) if isinstance(res.error, CollectiveMismatch) else None,
            "numels": {k: v["numel"] for k, v in res.error.fingerprints.items()}
            if isinstance(res.error, CollectiveMismatch)
            else None,
        },
    )
    # A mismatch moves no data, so the group is still usable.
    t = torch.ones(3)
    put("after_mismatch_ok", bool(safe_all_reduce(t, timeout=20)) and t.tolist() == [world] * 3)

    # Bad input: raised on the calling rank, before any communication (no record, no store round).
    seq_before = dict(recorder.last_seq())
    bad = {
        "not_tensor": lambda: safe_all_reduce([1.0, 2.0]),
        "sparse": lambda: safe_all_reduce(torch.eye(3).to_sparse()),
        "meta_device": lambda: safe_all_reduce(torch.empty(3, device="meta")),
        "timeout_zero": lambda: safe_all_reduce(torch.ones(3), timeout=0),
        "timeout_negative": lambda: safe_all_reduce(torch.ones(3), timeout=-1.5),
        "chunk_zero": lambda: safe_all_reduce(torch.ones(3), chunk_numel=0),
        "chunk_negative": lambda: safe_all_reduce(torch.ones(3), chunk_numel=-4),
        "avg_int": lambda: safe_all_reduce(torch.ones(3, dtype=torch.int64), op=R.AVG),
        "band_float": lambda: safe_all_reduce(torch.ones(3), op=R.BAND),
        "max_complex": lambda: safe_all_reduce(torch.ones(3, dtype=torch.complex64), op=R.MAX),
        "op_not_reduceop": lambda: safe_all_reduce(torch.ones(3), op="sum"),
    }
    sub = dist.new_group([0, 1])
    if r not in (0, 1):
        bad["not_member"] = lambda: safe_all_reduce(torch.ones(3), group=sub)
    raised = {}
    for name, call in bad.items():
        try:
            call()
            raised[name] = None
        except (TypeError, ValueError) as exc:
            raised[name] = [type(exc).__name__, str(exc)]
    put("bad_input", raised)
    put("bad_input_no_communication", recorder.last_seq() == seq_before)

    # 1,000 barriers leave the store small.
    store = dist.distributed_c10d._get_default_store()
    keys_before = store.num_keys()
    ok = all(bool(safe_barrier(timeout=20)) for _ in range(1000))
    safe_barrier(timeout=20)
    put("barriers_1000", {"all_ok": ok, "keys_before": keys_before, "keys_after": store.num_keys()})
    rankkit.done()


def stalls() -> None:
    r = rankkit.init()
    # Barrier: rank 2 arrives 3.5 s late for a 2 s barrier, and never before both others gave up
    # (a fixed sleep a loaded machine could outrun). Rank 1's own deadline is 2.5 s, so it always
    # learns rank 0's verdict before its own deadline: it was on time, not late. Rank 2's own
    # deadline is 20 s: told at once, it ends long before it, however loaded the machine.
    if r == 2:
        rankkit.fault_fired("late for a barrier")
        rankkit.wait_for("barrier-0", at_least_s=3.5)
        rankkit.wait_for("barrier-1")
    t0 = time.monotonic()
    b = safe_barrier(timeout={1: 2.5, 2: 20}.get(r, 2))
    try:
        b.raise_for_error()
        raised = None
    except CollectiveError as exc:
        raised = [type(exc).__name__, exc is b.error]
    put(
        "barrier",
        {
            "ok": b.ok,
            "missing": b.missing_ranks,
            "hosts": b.missing_hosts,
            "late": b.late,
            "elapsed": time.monotonic() - t0,
            "error": str(b.error),
            "error_type": type(b.error).__name__,
            "error_missing": getattr(b.error, "missing_ranks", None),
            "raised": raised,
        },
    )
    if r != 2:
        rankkit.announce(f"barrier-{r}")
    put("barrier_sync", bool(safe_barrier(timeout=10)))

    # all_reduce: rank 2 sleeps 10 s before entering; the others give up after 2 s.
    stall(2, 10)
    t = torch.full((4,), float(r + 1))
    before = t.clone()
    t0 = time.monotonic()
    res = safe_all_reduce(t, timeout=2)
    elapsed = time.monotonic() - t0
    err = res.error
    put(
        "stall",
        {
            "ok": res.ok,
            "elapsed": elapsed,
            "type": type(err).__name__,
            "is_timeout_error": isinstance(err, TimeoutError),
            "missing": getattr(err, "missing_ranks", None),
            "message": str(err),
            "fields": err.to_dict() if isinstance(err, CollectiveError) else None,
            "unchanged": torch.equal(t, before),
        },
    )
    if r != 2:
        t0 = time.monotonic()
        again = safe_all_reduce(torch.ones(2), timeout=2)
        put("after_timeout", {"ok": again.ok, "type": type(again.error).__name__, "elapsed": time.monotonic() - t0})
    rankkit.done()


def partial() -> None:
    r = rankkit.init()
    g_atomic = dist.new_group(backend="gloo")
    g_partial = dist.new_group(backend="gloo")

    # Rank 0 reduces 8 elements in 4 chunks of 2; ranks 1 and 2 take part in the first two
    # chunks only (plain all_reduce of 2 elements), then stop: a timeout in the middle.
    for name, group, atomic in (("atomic", g_atomic, True), ("partial", g_partial, False)):
        if r == 0:
            t = torch.arange(8, dtype=torch.float64) + 0.25
            before = t.clone()
            res = safe_all_reduce(t, group=group, timeout=2, chunk_numel=2, atomic=atomic, verify=False)
            time.sleep(0.5)  # let any write the backend still had in flight land before we look
            put(
                name,
                {
                    "ok": res.ok,
                    "type": type(res.error).__name__,
                    "reduced_numel": res.reduced_numel,
                    "chunk": list(res.error.chunk) if res.error else None,
                    "values": t.tolist(),
                    "bitwise_restored": torch.equal(t, before),
                    "before": before.tolist(),
                },
            )
        else:
            rankkit.fault_fired("stops after two chunks")
            for _ in range(2):
                dist.all_reduce(torch.full((2,), 1.0, dtype=torch.float64), group=group)
        safe_barrier(timeout=15)

    # A rank that exits before the collective: the survivors return within timeout + 1 s.
    leave(2)
    t0 = time.monotonic()
    res = safe_all_reduce(torch.ones(3), timeout=2)
    put(
        "exit",
        {
            "ok": res.ok,
            "elapsed": time.monotonic() - t0,
            "type": type(res.error).__name__,
            "missing": getattr(res.error, "missing_ranks", None),
            "message": str(res.error),
        },
    )
    rankkit.done()


if __name__ == "__main__":
    {"semantics": semantics, "stalls": stalls, "partial": partial}[sys.argv[1]]()
