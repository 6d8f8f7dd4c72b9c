"""The verdict's cut (``recovery/_verdict/levers.py``) and its release (``recovery/_verdict/release.py``):
this process's connections to a peer process are shut down, but never those of the job's store, on
real sockets to a real second process; a release cuts toward the live peers of this host only, and
only in a world on gloo alone; under NCCL's rules it aborts the groups (the stand-in cutting first).

The peer (a child process) listens on two ports: one stands for the job's store (``MASTER_PORT``;
under ncclguard's own launcher rank 0 hosts the store), the other for gloo's pairs. This process
connects to both; ``cut_connections(peer pid)`` must shut down the second and leave the first.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from ncclguard._naming import HOSTNAME
from ncclguard.backend_rules import rules_of
from ncclguard.incidents.model import Heartbeat
from ncclguard.recovery._verdict.levers import cut_connections, job_peer_pids, store_ports
from ncclguard.recovery._verdict.release import Release
from ncclguard.testing.launch import free_port

PEER = textwrap.dedent(
    """
    import os, socket, sys, time
    # The first stands for the store: on MASTER_PORT where the test gives one (a peer of the job).
    servers = [socket.create_server(("127.0.0.1", int(os.environ.get("MASTER_PORT", "0")))) for _ in range(1)]
    servers.append(socket.create_server(("127.0.0.1", 0)))
    print(*(s.getsockname()[1] for s in servers), flush=True)
    accepted = [s.accept()[0] for s in servers]  # held open until the test ends this process
    print("accepted", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def peer():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    yield from _peer(env)


@pytest.fixture
def job_peer(monkeypatch):
    """A peer of this process's job: both have MASTER_ADDR and MASTER_PORT (its store's port)."""
    port = str(free_port())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    yield from _peer({**os.environ})


def _peer(env):
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        store_port, gloo_port = (int(p) for p in proc.stdout.readline().split())
        yield proc, store_port, gloo_port
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def connected(peer):
    """This process's two connections to the peer, once the peer holds its ends (accepted: only then
    are they its sockets, which the cut looks up)."""
    proc, store_port, gloo_port = peer
    with (
        socket.create_connection(("127.0.0.1", store_port), timeout=30) as store,
        socket.create_connection(("127.0.0.1", gloo_port), timeout=30) as pair,
    ):
        assert proc.stdout.readline().strip() == "accepted"
        yield store, pair


def test_a_cut_shuts_down_the_peers_connections_but_never_the_stores(peer, monkeypatch):
    proc, store_port, gloo_port = peer
    monkeypatch.setenv("MASTER_PORT", str(store_port))
    assert store_port in store_ports()
    with connected(peer) as (store, pair):
        assert cut_connections(proc.pid) == 1
        # The pair's socket is shut down on this side: a read ends at once with nothing.
        assert pair.recv(1) == b""
        with pytest.raises(OSError):
            pair.sendall(b"x")
        # The store's is untouched: it still sends (a shut-down socket raises EPIPE).
        store.sendall(b"still here")
        cut_connections(proc.pid)  # a second cut (another look) leaves it too
        store.sendall(b"and here")


def test_a_cut_of_a_process_that_is_gone_shuts_down_nothing(peer):
    proc, _, _ = peer
    proc.kill()
    proc.wait(timeout=30)
    assert cut_connections(proc.pid) == 0


def beat(rank: int, pid: int, host: str) -> Heartbeat:
    return Heartbeat(
        rank=rank, host=host, pid=pid, beat=1, time=0.0, phase="", site="train.py:10",
        last_seq={}, last_completed={}, inflight=[],
    )  # fmt: skip


def test_a_release_cuts_toward_the_live_peers_of_this_host_only_and_only_on_gloo(peer, monkeypatch):
    proc, store_port, gloo_port = peer
    monkeypatch.setenv("MASTER_PORT", str(store_port))
    release = Release(None, 0, 4, rules_of("gloo"))
    assert not release.done and not release.aborts
    # Every beat names the child process: only rank 1's (alive, of this host) may be cut toward.
    beats = {
        1: (beat(1, proc.pid, HOSTNAME), 0.5),
        2: (beat(2, proc.pid, HOSTNAME), 0.5),  # the dead member
        3: (beat(3, proc.pid, HOSTNAME + "-elsewhere"), 0.5),  # another host: its pid means nothing here
    }
    with connected(peer) as (store, pair):
        done = release.release({2: "its process died"}, beats)
        assert done.cut == {1: 1} and done.dead == {2: "its process died"} and done.stuck == frozenset()
        assert done.aborted == ()
        assert release.done  # once per attempt
        assert pair.recv(1) == b""
        store.sendall(b"still here")


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_on_nccl_a_release_aborts_and_never_touches_a_socket(peer, monkeypatch, backend):
    """An NCCL op is not woken by a socket, and an error on NCCL's own would tear the process down."""
    proc, store_port, _ = peer
    monkeypatch.setenv("MASTER_PORT", str(store_port))
    release = Release(None, 0, 4, rules_of(backend))
    assert release.aborts
    with connected(peer) as (store, pair):
        done = release.release({2: "its process died"}, {1: (beat(1, proc.pid, HOSTNAME), 0.5)})
        assert done.cut == {} and release.done
        pair.settimeout(0.5)
        with pytest.raises(TimeoutError):  # nothing shut down: the read waits for data that never comes
            pair.recv(1)
        pair.sendall(b"still connected")


def test_the_stand_in_release_aborts_after_cutting_toward_the_jobs_processes_but_never_the_store(job_peer, peer):
    """gloo's abort wakes nothing, so the stand-in cuts first: an op in flight fails as NCCL's abort
    makes it, whether or not a watchdog named the peers (no beat is needed). Only the job's processes
    (the same MASTER_ADDR and MASTER_PORT) are cut toward: a process outside the job keeps its
    connection."""
    release = Release(None, 0, 4, rules_of("gloo", stand_in=True))
    assert release.aborts
    assert job_peer[0].pid in job_peer_pids() and peer[0].pid not in job_peer_pids()
    with connected(job_peer) as (store, pair), connected(peer) as (_, outside):
        done = release.release({2: "its process died"}, {})
        assert done.cut == {0: 1}  # counted under this rank: the pair to the job's peer
        assert pair.recv(1) == b""
        store.sendall(b"still here")
        outside.sendall(b"not of the job: untouched")
