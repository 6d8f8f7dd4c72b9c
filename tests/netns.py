"""Hosts on one machine, for the tests: network namespaces joined by veth pairs.

``pair``: two hosts joined by one veth pair. Namespace A holds 198.18.0.1/30, namespace B
198.18.0.2/30 (198.18.0.0/15 is the benchmarking range of RFC 2544; these addresses exist only inside
the namespaces, which have no other interface than loopback, so nothing can leave them).

``star``: three hosts on a switch: host ``i`` holds 198.18.1.<i+1>/24 on a veth whose other end is a
port of a bridge in a fourth namespace (the switch), so that each host has a link of its own that a
test can slow down (``tc`` on both of its ends: :func:`slow_host`) while the others keep theirs.
:func:`make_star` and :func:`remove_star` make and remove one outside pytest (the straggler drill).

Both are module-scoped fixtures: import them into a test module to use them. Everything made is
removed at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
WORKERS = Path(__file__).parent / "workers"
ADDR_A, ADDR_B = "198.18.0.1", "198.18.0.2"


@dataclass(frozen=True)
class Pair:
    ns_a: str
    ns_b: str
    if_a: str
    if_b: str


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=check)


def _why_not() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` program (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the suite as root to include this test)"
    probe = f"ncgprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _kill_inside(ns: str) -> None:
    """Ends what a failed test left running in ``ns`` (only processes this test started live there)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="module")
def pair():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = f"ncg{os.getpid()}"
    p = Pair(ns_a=f"{tag}-a", ns_b=f"{tag}-b", if_a=f"{tag}a"[:15], if_b=f"{tag}b"[:15])
    try:
        for ns in (p.ns_a, p.ns_b):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", p.if_a, "netns", p.ns_a, "type", "veth", "peer", "name", p.if_b, "netns", p.ns_b)
        for ns, ifname, addr in ((p.ns_a, p.if_a, ADDR_A), (p.ns_b, p.if_b, ADDR_B)):
            _ip("addr", "add", f"{addr}/30", "dev", ifname, ns=ns)
            _ip("link", "set", ifname, "up", ns=ns)
        yield p
    finally:
        for ns in (p.ns_a, p.ns_b):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)  # takes the veth pair with it


@contextlib.contextmanager
def hosts_files(extra: dict[str, str]) -> Iterator[None]:
    """Each namespace's own hosts file (``ip netns exec`` reads /etc/netns/<ns>/hosts over /etc/hosts):
    localhost, this machine's hostname at 127.0.1.1 (as wherever /etc/hosts maps it to loopback), then
    the namespace's ``extra`` lines; removed on the way out."""
    made = []
    try:
        for ns, lines in extra.items():
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            made.append(folder)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n{lines}")
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def hosts(pair):
    """The pair, with this machine's hostname resolving to 127.0.1.1 inside both namespaces."""
    with hosts_files({pair.ns_a: "", pair.ns_b: ""}):
        yield pair


@dataclass(frozen=True)
class Star:
    hosts: tuple[str, ...]  # the hosts' namespaces, host i at STAR_ADDRS[i]
    switch: str  # the bridge's namespace
    host_ifs: tuple[str, ...]  # each host's end of its link (in its namespace)
    switch_ifs: tuple[str, ...]  # the switch's end of each host's link (in the switch's namespace)


STAR_ADDRS = tuple(f"198.18.1.{i + 1}" for i in range(8))


def make_star(tag: str, hosts: int = 3) -> Star:
    """Makes ``hosts`` host namespaces and a switch (a bridge in a namespace of its own), one veth
    pair from each host to the switch; ``tag`` names them (short: interface names hold 15 characters)."""
    star = Star(
        hosts=tuple(f"{tag}-h{i}" for i in range(hosts)),
        switch=f"{tag}-sw",
        host_ifs=tuple(f"{tag}h{i}"[:15] for i in range(hosts)),
        switch_ifs=tuple(f"{tag}s{i}"[:15] for i in range(hosts)),
    )
    try:
        for ns in (star.switch, *star.hosts):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", "br0", "type", "bridge", ns=star.switch)
        _ip("link", "set", "br0", "up", ns=star.switch)
        for i, ns in enumerate(star.hosts):
            h, sw = star.host_ifs[i], star.switch_ifs[i]
            _ip("link", "add", h, "netns", ns, "type", "veth", "peer", "name", sw, "netns", star.switch)
            _ip("addr", "add", f"{STAR_ADDRS[i]}/24", "dev", h, ns=ns)
            _ip("link", "set", h, "up", ns=ns)
            _ip("link", "set", sw, "master", "br0", ns=star.switch)
            _ip("link", "set", sw, "up", ns=star.switch)
    except BaseException:
        remove_star(star)
        raise
    return star


def remove_star(star: Star) -> None:
    """Ends what is left running in the star's namespaces and removes them (their veths go with them)."""
    for ns in (*star.hosts, star.switch):
        if _ip("netns", "pids", ns, check=False).returncode == 0:
            _kill_inside(ns)
        _ip("netns", "del", ns, check=False)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20, check=check
    )


def slow_host(star: Star, host: int, rate: str) -> None:
    """Rate-limits host ``host``'s link both ways (``tc ... tbf`` on its end and on the switch's end)."""
    for ns, ifname in ((star.hosts[host], star.host_ifs[host]), (star.switch, star.switch_ifs[host])):
        _tc(ns, "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms")


def unslow_host(star: Star, host: int) -> None:
    """Takes the rate limit of :func:`slow_host` off."""
    for ns, ifname in ((star.hosts[host], star.host_ifs[host]), (star.switch, star.switch_ifs[host])):
        _tc(ns, "qdisc", "del", "dev", ifname, "root", check=False)


@pytest.fixture(scope="module")
def star():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    made = make_star(f"ncs{os.getpid() % 100000}")
    try:
        yield made
    finally:
        remove_star(made)


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCHELASTIC_", "MASTER_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKERS), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def _run_in(
    namespaces: list[tuple[str, list[str], dict[str, str]]], timeout_s: float
) -> list[subprocess.CompletedProcess]:
    """Runs one command per namespace at the same time; all are killed past ``timeout_s``."""
    procs = []
    deadline = time.monotonic() + timeout_s
    for ns, argv, env in namespaces:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        procs.append((proc, out, err, argv))
    done = []
    late = None
    for proc, _out, _err, argv in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            late = argv
            for p, *_ in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:  # this one had already exited: kill the others all the same
                    pass
            break
    for proc, out, err, argv in procs:
        proc.wait()
        out.seek(0)
        err.seek(0)
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if late is not None:
        tails = "\n".join(f"--- {d.args}\n{d.stdout[-2000:]}{d.stderr[-4000:]}" for d in done)
        raise AssertionError(f"{late} did not finish within {timeout_s} s\n{tails}")
    return done


def run_two_ranks(
    pair: Pair, argv: list[str], out: Path, port: int, timeout_s: float
) -> list[subprocess.CompletedProcess]:
    """Runs ``argv`` as rank 0 in namespace A (the store's host) and rank 1 in B, a world of 2.

    Each rank writes its results under ``out`` (``NCCLGUARD_TEST_OUT``); both are killed past
    ``timeout_s``.
    """
    common = dict(
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=ADDR_A,
        MASTER_PORT=str(port),
        NCCLGUARD_TEST_OUT=str(out),
        OMP_NUM_THREADS="1",
    )
    return _run_in(
        [
            (pair.ns_a, argv, _env(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", **common)),
            (pair.ns_b, argv, _env(RANK="1", LOCAL_RANK="0", GROUP_RANK="1", **common)),
        ],
        timeout_s,
    )


def run_star_ranks(
    star: Star, argv: list[str], out: Path, port: int, timeout_s: float, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Runs ``argv`` as rank ``i`` on host ``i`` of ``star`` (rank 0's host holds the store), a world of
    ``len(star.hosts)``; each rank writes its results under ``out``; all are killed past ``timeout_s``."""
    n = len(star.hosts)
    common = dict(
        WORLD_SIZE=str(n),
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=STAR_ADDRS[0],
        MASTER_PORT=str(port),
        NCCLGUARD_TEST_OUT=str(out),
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    runs: Sequence[tuple[str, list[str], dict[str, str]]] = [
        (ns, argv, _env(RANK=str(i), LOCAL_RANK="0", GROUP_RANK=str(i), **common)) for i, ns in enumerate(star.hosts)
    ]
    return _run_in(list(runs), timeout_s)
