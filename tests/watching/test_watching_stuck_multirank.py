"""A stuck transport on real gloo ranks, told from the backend's numbers alone: a DDP all_reduce
(issued from C++, so ncclguard recorded nothing) that neither rank can finish because the data
link went down, while the store's link stays up.

Two network namespaces (tests/netns.py's pair carries the store and the heartbeats; this module
adds a second veth pair, 198.18.0.4/30, for gloo's data). Needs root and iproute2; skipped
otherwise. tests/workers/stuck_worker.py is the rank side.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from netns import ADDR_A, WORKERS, _env, _ip, _run_in, pair  # noqa: F401 - pair is a fixture

pytestmark = pytest.mark.multirank
HEARTBEAT_S = 0.3  # as in the worker
HANG_S = 1.5
# Hang guard on the report: over 3x the 1.60-2.02 s loaded runs took (docs/diagnosis.md; the bound
# hang_timeout_s + 2 * heartbeat_s is 2.1 s). Order is asserted too: the link comes back only after.
REPORT_GUARD_S = 7.0
DATA_A, DATA_B = "198.18.0.5", "198.18.0.6"


def mark(name: str) -> int:
    source = (WORKERS / "stuck_worker.py").read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


@pytest.fixture(scope="module")
def stuck(pair):  # noqa: F811 - the fixture imported above
    tag = f"ncd{os.getpid()}"
    if_a, if_b = f"{tag}a"[:15], f"{tag}b"[:15]
    _ip("link", "add", if_a, "netns", pair.ns_a, "type", "veth", "peer", "name", if_b, "netns", pair.ns_b)
    for ns, ifname, addr in ((pair.ns_a, if_a, DATA_A), (pair.ns_b, if_b, DATA_B)):
        _ip("addr", "add", f"{addr}/30", "dev", ifname, ns=ns)
        _ip("link", "set", ifname, "up", ns=ns)
    out = Path(tempfile.mkdtemp(prefix="ncclguard-stuck-"))
    argv = [sys.executable, str(WORKERS / "stuck_worker.py")]
    common = dict(
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=ADDR_A,
        MASTER_PORT="29502",
        NCCLGUARD_TEST_OUT=str(out),
        OMP_NUM_THREADS="1",
    )
    ranks = _run_in(
        [
            (pair.ns_a, argv, _env(RANK="0", LOCAL_RANK="0", GLOO_SOCKET_IFNAME=if_a, **common)),
            (pair.ns_b, argv, _env(RANK="1", LOCAL_RANK="0", GLOO_SOCKET_IFNAME=if_b, **common)),
        ],
        timeout_s=90,
    )
    for r in ranks:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    (where,) = [p.parent for p in (out / "incidents").glob("*/incident.json")]
    return res, json.loads((where / "incident.json").read_text()), (where / "summary.txt").read_text()


def test_both_ranks_waiting_at_one_backend_number_is_a_stuck_transport_not_a_desync(stuck):
    res, inc, text = stuck
    assert inc["incident"]["kind"] == "stuck"
    assert inc["incident"]["reason"].endswith(" (in gloo:all_reduce)")
    (finding,) = inc["findings"]
    assert (finding["kind"], finding["backend"], finding["waiting"]) == ("stuck", True, [0, 1])
    assert (finding["op"], finding["numel"], finding["dtype"]) == ("gloo:all_reduce", 16 * 16 + 16, "float32")
    assert finding["site"].startswith("C++ (not a torch.distributed Python call")
    assert finding["site"].endswith(f"stuck_worker.py:{mark('stuck')}") and finding["phase"] == "train step=3"
    assert (inc["culprits"], inc["victims"]) == ([], [0, 1])
    assert "a stuck transport, not a desync" in inc["summary"]
    assert "Suspect the network/transport" in text
    for r in (0, 1):  # ncclguard recorded none of it: the backend's numbers and torch's recorder did
        assert inc["ranks"][str(r)]["inflight"] == []
        assert inc["ranks"][str(r)]["backend_ops"]["0"]["completed"] is False


def test_the_report_is_on_disk_within_hang_timeout_plus_two_heartbeats(stuck):
    res, inc, _ = stuck
    started = max(res[r]["start"] for r in (0, 1))  # the op is stuck once both are in it
    assert HANG_S <= inc["written_at"] - started <= REPORT_GUARD_S, inc["written_at"] - started


def test_once_the_link_is_back_the_all_reduce_completes_exactly(stuck):
    res, inc, _ = stuck
    for r in (0, 1):
        assert res[r]["grad_exact"] is True
        before, after = res[r]["seq"]
        assert after == before + 1  # one backend op: the bucket all_reduce
        assert res[r]["done"] > res[0]["restored_at"] >= inc["written_at"]
