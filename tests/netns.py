"""Two hosts on one machine, for the tests: network namespaces joined by a veth pair.

Namespace A holds 198.18.0.1/30, namespace B 198.18.0.2/30 (198.18.0.0/15 is the benchmarking
range of RFC 2544; these addresses exist only inside the two namespaces, which have no other
interface than loopback, so nothing can leave them). ``pair`` is a module-scoped fixture: import
it into a test module to use it. Everything made is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
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
