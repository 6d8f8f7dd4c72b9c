"""Rank side of tests/house/test_torch_compat.py: every entry of ncclguard._torch_compat on a live gloo group."""

from __future__ import annotations

import json
from datetime import timedelta

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import _torch_compat as compat


def main() -> None:
    rank = rankkit.init(timeout_s=30)
    world = compat.default_group()
    put("default_is_world", world is dist.group.WORLD or world is dist.distributed_c10d.GroupMember.WORLD)
    put("store_roundtrip", _store_roundtrip())
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=7))
    names = compat.group_names()
    put("names_has_sub", names.get(sub) == sub.group_name)
    put("ranks_of_sub", sorted(compat.group_ranks()[sub]))
    put("group_store_is_store", compat.group_store(world) is not None)
    put("not_in_group", compat.rank_not_in_group(sub))
    put("sub_timeout_s", compat.backend_timeout(sub).total_seconds())
    read_timeout = compat.backend_timeout_reader(sub)
    compat.set_group_timeout(sub, timedelta(seconds=4))
    put("sub_timeout_after_set_s", compat.backend_timeout(sub).total_seconds())
    put("reader_after_set_s", read_timeout())
    before = compat.sequence_number(world)
    dist.all_reduce(torch.ones(3))
    put("seq_advance", compat.sequence_number(world) - before)
    doc = json.loads(compat.dump_flight_recorder())
    names_seen = [e.get("profiling_name") for e in doc.get("entries", [])]
    put("fr_has_all_reduce", any(n and "all_reduce" in n for n in names_seen))
    put("fr_available", compat.flight_recorder_available())
    fn = compat.get_default_timeout_fn()
    put("default_timeout_fn_s", fn("gloo").total_seconds())
    side = dist.new_group([0, 1], backend="gloo")
    t = torch.full((2,), float(rank + 1))
    with compat.routed_default_group(side):
        before_side = compat.sequence_number(side)
        dist.all_reduce(t)
        put("routed_side_advance", compat.sequence_number(side) - before_side)
    put("routed_sum", t.tolist())
    put("default_restored", compat.default_group() is world)
    rankkit.done()


def _store_roundtrip() -> str:
    store = compat.default_store()
    store.set(f"compat/{dist.get_rank()}", b"ok")
    return store.get(f"compat/{dist.get_rank()}").decode()


if __name__ == "__main__":
    main()
