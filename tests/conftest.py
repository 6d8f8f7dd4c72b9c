import logging
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from ncclguard.config import configure, get_config
from ncclguard.world import World, announce

# Worker scripts and the fixtures they share (the reference trainer, synthetic Qwen2.5-VL data)
# live in tests/workers, importable by top-level name, as the ranks import them.
sys.path.insert(0, str(Path(__file__).parent / "workers"))

from netns import hosts, pair  # noqa: F401 - the two-host fixtures of the netns tests

# A loaded CI machine generates examples slowly now and then: hypothesis's "too slow" health check
# (and per-example deadline) would fail a test by chance, not for what it checks.
settings.register_profile("loaded", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("loaded")


@pytest.fixture(params=["compiled", "generated"])
def wrapper_kind(request, monkeypatch):
    """instrument() installs the compiled wrapper (_hotpath.c) or the generated Python one, the
    recorder cleared before and after: a test that takes this fixture runs with both."""
    from ncclguard.recording import instrument as ins
    from ncclguard.recording.flight import recorder

    if request.param == "compiled" and ins._hotpath is None:
        pytest.skip("the compiled wrapper is not built in this install (setup.py builds it with a C compiler)")
    if request.param == "generated":
        monkeypatch.setattr(ins, "_hotpath", None)
    ins.uninstrument()
    recorder.clear()
    yield request.param
    ins.uninstrument()
    recorder.clear()


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the configuration in force before it, whatever it configured."""
    saved = get_config().model_dump()
    yield
    configure(**saved)
    logging.getLogger("ncclguard").handlers.clear()
    if not dist.is_initialized():
        # A world of one without a process group is never rebuilt, so nothing else clears its
        # per-world state (the commits' step numbers): each in-process test starts in a fresh one,
        # announced as a rebuild would, so that every subscriber follows it.
        announce(World())


# Test files that take a minute or more without launching ranks through torchrun (a drill in process,
# many simulated ranks), scheduled with the launches.
_HEAVY = ("test_failure_drill.py", "test_preempt.py", "test_watching_scale.py", "test_supervise_stuck.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The launches of real ranks first, then everything else, each in its collected order: under
    ``pytest -n 2 --dist loadfile`` a file goes whole to one worker, and a launch of a minute or more
    left for the end kept the other worker idle (the suite's last 5% took 10 of its 27 minutes). The
    many short tests now fill the end on both workers (the Makefile's ``--no-loadscope-reorder`` keeps
    this order: pytest-xdist's own puts the files with the most tests first). Three workers were tried: 3-4 minutes faster,
    but two runs of three failed on load (a heartbeat read before its set landed; the stacks' and the
    stragglers' timing under a starved rank), so two it stays."""
    heavy = {it.path for it in items if it.get_closest_marker("multirank") or it.path.name in _HEAVY}
    items.sort(key=lambda it: 0 if it.path in heavy else 1)  # stable: a file's tests stay together, in order
