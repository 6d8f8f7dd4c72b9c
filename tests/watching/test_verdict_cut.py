"""The verdict's cut (``recovery/_verdict/levers.py``): this process's connections to a peer process
are shut down, but never those of the job's store, on real sockets to a real second process.

The peer (a child process) listens on two ports: one stands for the job's store (``MASTER_PORT``;
under ncclguard's own launcher rank 0 hosts the store), the other for gloo's pairs. This process
connects to both; ``cut_connections(peer pid)`` must shut down the second and leave the first.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from ncclguard.recovery._verdict.levers import cut_connections, store_ports

PEER = textwrap.dedent(
    """
    import socket, sys, time
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    print(*(s.getsockname()[1] for s in servers), flush=True)
    accepted = [s.accept()[0] for s in servers]  # held open until the test ends this process
    time.sleep(120)
    """
)


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        store_port, gloo_port = (int(p) for p in proc.stdout.readline().split())
        yield proc, store_port, gloo_port
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_cut_shuts_down_the_peers_connections_but_never_the_stores(peer, monkeypatch):
    proc, store_port, gloo_port = peer
    monkeypatch.setenv("MASTER_PORT", str(store_port))
    assert store_port in store_ports()
    with (
        socket.create_connection(("127.0.0.1", store_port), timeout=30) as store,
        socket.create_connection(("127.0.0.1", gloo_port), timeout=30) as pair,
    ):
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
