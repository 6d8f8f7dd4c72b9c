"""Ranks seeded apart, where a heal from a live peer would hand a restarted rank its peer's
generators (ncclguard/recovery/_step/seeds.py): refused with heal=True, said once with the default
heal, silent with one seed on every rank. 3 real gloo ranks under the supervisor; rank side:
tests/workers/seeds_worker.py. One launch, three parts in the same world."""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def job():
    # About 20 s here (three small BERTs, 3 steps each); hang guard 180 s.
    return run_ranks("seeds_worker", 3, timeout_s=180, supervise=["--restarts=1"])


def test_one_seed_on_every_rank_heals_with_nothing_said_and_no_rebuild(job):
    for r in range(3):
        part = job[r]["together"]
        assert part["heal"] is True and part["raised"] is None and part["lines"] == [], part
        assert part["results"] == [{"ok": True, "attempts": 1, "generation": 0}] * 3, part
        assert job[r]["final"] == [r, 3, 0]  # no rebuild in the whole launch


def test_a_seed_per_rank_under_the_default_heal_is_said_once_and_training_goes_on(job):
    for r in range(3):
        part = job[r]["default"]
        assert part["heal"] is True and part["raised"] is None, part  # on by default under the supervisor
        assert part["results"] == [{"ok": True, "attempts": 1, "generation": 0}] * 3, part
        assert len(part["lines"]) == 1, part
        line = part["lines"][0]
        # transformers.set_seed seeds random, NumPy and torch apart; the step draws from torch's only
        # (dropout), so only torch's is compared
        assert "generators are not alike at step 10 (torch differ on ranks 0-2: a seed per rank?)" in line, line
        assert "at step 10" in line and "set_seed(seed) without device_specific=True" in line, line


def test_a_seed_per_rank_with_heal_true_is_refused_on_every_rank_before_the_step_is_applied(job):
    texts = set()
    for r in range(3):
        part = job[r]["apart"]
        assert part["results"] == [] and part["unchanged"] is True, part
        assert part["raised"]["type"] == "GeneratorsApart" and part["raised"]["step"] == 20, part
        texts.add(part["raised"]["text"])
    (text,) = texts  # the same words on every rank: they read one outcome
    assert "heal=True hands a restarted rank a live peer's generators" in text, text
    assert "or pass heal=False" in text, text
