"""The World: per-world state by slot, announcements to subscribers, retirement (no processes)."""

from __future__ import annotations

import threading

import pytest

from ncclguard import world as world_module
from ncclguard.errors import RebuildFailed
from ncclguard.world import Slot, World, WorldChange, announce, current_world, notify, subscribe


@pytest.fixture
def restore_world():
    """Each test leaves the process in the world it found: later tests in this process must not
    run in a generation of this test's making (announce itself never goes back)."""
    before = current_world()
    yield before
    world_module._worlds.current = before
    announce(before)  # the same generation: every subscriber follows it back


def test_a_slot_is_built_once_per_world_and_a_new_world_starts_afresh(restore_world):
    built: list[int] = []
    counter: Slot[list[int]] = Slot("counter", lambda w: built.append(w.generation) or [])
    first = World(generation=restore_world.generation)
    first.get(counter).append(1)
    assert first.get(counter) == [1] and built == [first.generation]
    second = World(generation=first.generation + 1)
    assert second.get(counter) == [] and built == [first.generation, first.generation + 1]
    first.retire()
    assert first.get(counter) == [] and len(built) == 3  # a retired world keeps nothing


def test_concurrent_first_use_builds_one_state():
    calls: list[int] = []
    slot: Slot[object] = Slot("shared", lambda w: calls.append(1) or object())
    world = World()
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(world.get(slot))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len({id(g) for g in got}) == 1


def test_announce_tells_subscribers_in_order_and_survives_a_raising_one(restore_world, caplog):
    seen: list[tuple[int, int]] = []

    def bad(change: WorldChange) -> None:
        raise RuntimeError("subscriber bug")

    unsubscribe_bad = subscribe(bad)
    unsubscribe_good = subscribe(lambda c: seen.append((c.old.generation, c.new.generation)))
    try:
        new = World(generation=restore_world.generation + 1, rank=1, size=3, rank_map={0: 0, 2: 1, 3: 2}, left_out=(1,))
        change = announce(new)
        assert current_world() is new and change.old is restore_world and change.new is new
        assert seen == [(restore_world.generation, restore_world.generation + 1)]
        assert "subscriber bug" in caplog.text or "raised on generation" in caplog.text
        assert new.old_rank(1) == 2 and new.old_rank(0) == 0 and new.old_rank(5) is None
    finally:
        unsubscribe_bad()
        unsubscribe_good()
    announce(World(generation=new.generation))
    assert seen == [(restore_world.generation, restore_world.generation + 1)]  # unsubscribed: not told


def test_an_older_generation_is_refused_and_nothing_changes(restore_world):
    announce(World(generation=restore_world.generation + 2))
    now = current_world()
    with pytest.raises(ValueError, match=r"generation \d+ is older than the current \d+"):
        announce(World(generation=restore_world.generation))
    assert current_world() is now


def test_subscribe_refuses_what_it_cannot_call():
    with pytest.raises(TypeError, match="subscribe needs a callable taking a WorldChange, got int"):
        subscribe(3)  # type: ignore[arg-type]


def test_a_subscriber_is_told_only_the_kinds_it_asked_for(restore_world):
    # One hook for every change of the world: announcements (the default), a rebuild's end, and
    # this rank left out; a part holding per-world resources asks for the announcements alone.
    told: dict[str, list[tuple[str, int | None]]] = {"default": [], "rebuilt": [], "all": []}
    removers = [
        subscribe(lambda c: told["default"].append((c.kind, c.step))),
        subscribe(lambda c: told["rebuilt"].append((c.kind, c.step)), kinds=("rebuilt",)),
        subscribe(lambda c: told["all"].append((c.kind, c.step)), kinds=("announced", "rebuilt", "left_out")),
    ]
    try:
        old = current_world()
        new = World(generation=old.generation + 1, rank=0, size=2, rank_map={0: 0, 2: 1}, left_out=(1,))
        announce(new)
        notify(WorldChange(old, new, "rebuilt", step=7))
        left = RebuildFailed("the others went on without this rank", late=True)
        notify(WorldChange(new, new, "left_out", step=8, error=left))
    finally:
        for remove in removers:
            remove()
    assert told["default"] == [("announced", None)]
    assert told["rebuilt"] == [("rebuilt", 7)]
    assert told["all"] == [("announced", None), ("rebuilt", 7), ("left_out", 8)]
    assert current_world() is new  # notify tells; only announce makes a world current


def test_kinds_and_notify_refuse_what_they_cannot_tell():
    with pytest.raises(TypeError, match="collection of kinds"):
        subscribe(print, kinds="rebuilt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kinds must name some of"):
        subscribe(print, kinds=("rebuit",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kinds must name some of"):
        subscribe(print, kinds=())
    world = current_world()
    with pytest.raises(ValueError, match="notify tells"):
        notify(WorldChange(world, world))  # an announcement goes through announce
