"""safe_all_reduce's per-world state and the recorder's numbering follow a world change.

A world change is :func:`ncclguard.world.announce` (``rebuild_world`` makes one): the recorder
forgets its records and counters, the old world's group plans are dropped (each holds its group)
and so are its atomic buffers, and the next call builds its plan in the new world.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ncclguard import safe_all_reduce
from ncclguard import world as world_module
from ncclguard.collectives import plan as plans
from ncclguard.collectives.wire import retained_atomic_bytes
from ncclguard.recording.flight import recorder
from ncclguard.world import World, announce, current_world


@pytest.fixture
def world_of_one():
    before = current_world()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    # Later tests in this process run in the world they would have found (announce never goes
    # back a generation: put it back, then announce it so that every subscriber follows).
    world_module._worlds.current = before
    announce(before)


def test_a_world_change_starts_the_numbering_the_plans_and_the_buffers_afresh(world_of_one) -> None:
    assert safe_all_reduce(torch.ones(3))
    old = plans.hot.plans
    assert old.by_group  # the default group's plan, built by the call
    old_world = current_world()
    rec = recorder.start("all_reduce(SUM)", "0", 3, "float32", site="here")
    recorder.finish(rec)
    assert recorder.last_seq()

    announce(World(generation=old_world.generation + 1))

    assert recorder.last_seq() == {} and recorder.records() == []
    assert not old.by_group  # the abandoned groups are not kept alive by their plans
    assert plans.hot.plans is current_world().get(plans.PLANS) is not old
    assert retained_atomic_bytes() == 0
    assert safe_all_reduce(torch.ones(3))
    assert plans.hot.plans.by_group


def test_the_shape_cache_checks_every_new_shape_and_refuses_bad_input_every_time(world_of_one) -> None:
    plan = plans.plan_for(None)
    assert plan is not None
    t = torch.ones(4)
    first = plan.shape(t, dist.ReduceOp.SUM, None)
    assert plan.shape(torch.zeros(4), dist.ReduceOp.SUM, None) is first  # same op, dtype, numel, device
    assert plan.shape(torch.ones(5), dist.ReduceOp.SUM, None) is not first
    for _ in range(2):  # bad input is never cached: it raises each time
        with pytest.raises(TypeError, match="integer or bool"):
            plan.shape(t, dist.ReduceOp.BAND, None)
        with pytest.raises(ValueError, match="chunk_numel"):
            plan.shape(t, dist.ReduceOp.SUM, True)
        with pytest.raises(ValueError, match="moves only"):
            plan.shape(torch.ones(4, device="meta"), dist.ReduceOp.SUM, None)
