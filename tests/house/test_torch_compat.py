"""ncclguard._torch_compat: each private torch entry works on torch 2.13, and refuses clearly when gated.

The live part is one torchrun launch of tests/workers/compat_worker.py on 2 gloo ranks, no fault: each
entry (default group and store, group names, ranks and timeouts, setting a group's timeout, sequence
numbers, the flight recorder's dump, the default group routed to a side group) is called on the live
groups and what it returned is saved for the tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import run_ranks

from ncclguard import _torch_compat as compat
from ncclguard.errors import NcclGuardError, TorchCompatError


@pytest.fixture(scope="module")
def live():
    return run_ranks("compat_worker", 2, timeout_s=90)


def test_every_private_api_is_gated():
    # Each gated name is used by some entry; a new private access must be added to the table.
    assert set(compat.API_MIN_VERSION) >= {
        "distributed_c10d._world",
        "distributed_c10d._get_default_group",
        "distributed_c10d._get_default_store",
        "distributed_c10d._set_pg_timeout",
        "ProcessGroup._get_sequence_number_for_group",
        "torch._C._distributed_c10d._dump_fr_trace_json",
        "torch.utils.data.dataloader._BaseDataLoaderIter",
    }
    assert compat.TORCH_VERSION >= (2, 4)


def test_old_torch_is_refused_with_the_api_named(monkeypatch):
    monkeypatch.setattr(compat, "TORCH_VERSION", (1, 13))
    compat._c10d_attr.cache_clear()
    try:
        with pytest.raises(TorchCompatError, match=r"distributed_c10d\._world.*torch 2\.0"):
            compat.world()
        with pytest.raises(TorchCompatError, match="_get_sequence_number_for_group"):
            compat.sequence_number(object())
        assert not compat.flight_recorder_available()
    finally:
        compat._c10d_attr.cache_clear()


def test_missing_attribute_is_refused_with_the_api_named():
    class NoSeq:
        pass

    with pytest.raises(TorchCompatError, match=r"no usable ProcessGroup\._get_sequence_number_for_group"):
        compat.sequence_number(NoSeq())
    with pytest.raises(TorchCompatError, match=r"options\._timeout"):
        compat.backend_timeout(NoSeq())
    with pytest.raises(TorchCompatError, match=r"options\._timeout"):
        compat.backend_timeout_reader(NoSeq())
    assert issubclass(TorchCompatError, NcclGuardError)


def test_with_no_world_the_quiet_destroy_sets_torchs_group_counter_back_as_torchs_destroy_does():
    # A failed init_process_group counted its group's name; the next handshake must name the group
    # as a peer that counted none does. In a fresh process: this one's world is the suite's business.
    code = (
        "import torch.distributed as dist\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "from ncclguard import _torch_compat as compat\n"
        "compat.world().group_count = 2\n"
        "before = c10d.get_pg_count()\n"
        "compat.destroy_world_quietly()\n"
        "print(dist.is_initialized(), before, c10d.get_pg_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "2", "0"], out.stderr


def test_nccl_recorder_absent_on_a_cpu_build_is_a_clear_error():
    import torch

    if hasattr(torch._C._distributed_c10d, "_dump_nccl_trace_json"):
        pytest.skip("this torch has NCCL")
    with pytest.raises(TorchCompatError, match="_dump_nccl_trace_json"):
        compat.dump_flight_recorder(nccl=True)


@pytest.mark.multirank
def test_entries_on_a_live_gloo_group(live):
    for rank in (0, 1):
        r = live[rank]
        assert r["default_is_world"] is True
        assert r["store_roundtrip"] == "ok"
        assert r["names_has_sub"] is True
        assert r["ranks_of_sub"] == [0, 1]
        assert r["group_store_is_store"] is True
        assert r["not_in_group"] is False
        assert r["sub_timeout_s"] == 7.0
        assert r["sub_timeout_after_set_s"] == 4.0
        assert r["reader_after_set_s"] == 4.0  # the reader sees the change made after it was built
        assert r["seq_advance"] == 1
        assert r["fr_available"] is True and r["fr_has_all_reduce"] is True
        assert r["default_timeout_fn_s"] == 1800.0
        assert r["routed_side_advance"] == 1
        assert r["routed_sum"] == [3.0, 3.0]
        assert r["default_restored"] is True


def test_rebind_group_defaults_unbinds_only_the_abandoned_groups(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.nn.functional as fn

    abandoned = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    kept = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    # As torch binds them when the module is imported with a world group up.
    monkeypatch.setattr(fn.all_reduce, "__defaults__", (dist.ReduceOp.SUM, abandoned))
    monkeypatch.setattr(fn.all_gather, "__defaults__", (kept,))
    assert compat.rebind_group_defaults([abandoned]) == ["all_reduce"]
    assert fn.all_reduce.__defaults__ == (dist.ReduceOp.SUM, None)
    assert fn.all_gather.__defaults__[0] is kept
    assert compat.rebind_group_defaults([abandoned]) == []


def test_work_error_reads_a_completed_work_and_falls_back_where_the_binding_breaks():
    class Ok:
        def exception(self):
            return None

    class Failed:
        def exception(self):
            return RuntimeError("NCCL error: unhandled system error")

    class BrokenBinding:  # torch 2.11.0+cu130: exception() cannot convert its exception_ptr
        def __init__(self, error=None):
            self.error, self.waited = error, 0

        def exception(self):
            raise TypeError("Unable to convert function return value to a Python type!")

        def wait(self):
            self.waited += 1
            if self.error:
                raise self.error

    assert compat.work_error(Ok()) is None
    assert str(compat.work_error(Failed())) == "NCCL error: unhandled system error"
    ok = BrokenBinding()
    assert compat.work_error(ok) is None and ok.waited == 1
    bad = BrokenBinding(RuntimeError("peer closed"))
    assert str(compat.work_error(bad)) == "peer closed" and bad.waited == 1


def test_the_dataloader_iterator_class_is_what_a_dataloader_returns_and_refused_when_gone(monkeypatch):
    from torch.utils.data import DataLoader, dataloader

    assert isinstance(iter(DataLoader(list(range(4)))), compat.dataloader_iter_class())
    monkeypatch.delattr(dataloader, "_BaseDataLoaderIter")
    with pytest.raises(TorchCompatError, match=r"no usable torch\.utils\.data\.dataloader\._BaseDataLoaderIter"):
        compat.dataloader_iter_class()


def test_the_world_teardown_hook_sees_every_users_destroy_of_the_world_before_its_store_goes():
    # A world of one in this process, on a HashStore; the name bound at import is the tutorials' way.
    import torch.distributed as dist
    from torch.distributed import destroy_process_group

    seen: list[str] = []

    def before() -> None:
        store = compat.default_store()  # still there: torch lets go of the groups and store after
        store.set("alive", "1")
        seen.append(store.get("alive").decode())

    undo = compat.hook_world_teardown(before)
    try:
        for n, destroy in enumerate((destroy_process_group, lambda: dist.destroy_process_group())):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            sub = dist.new_group([0])
            dist.destroy_process_group(sub)  # a group, not the world: nothing
            assert seen == ["1"] * n
            destroy()
            assert not dist.is_initialized() and seen == ["1"] * (n + 1)
        assert seen == ["1", "1"]
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        compat.destroy_world_quietly()  # ncclguard's rebuild: no end, nothing to tell
        assert not dist.is_initialized() and seen == ["1", "1"]
    finally:
        undo()
        if dist.is_initialized():
            dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    destroy_process_group()  # undone: nothing
    assert seen == ["1", "1"]
