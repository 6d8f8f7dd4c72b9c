"""heal_from_peer: a live rank sends the model's and the optimizer's state to the restarted ranks
that joined at the last rebuild, over the world group (a side gloo group where the world's backend
carries no CPU tensor: NCCL, :mod:`ncclguard.backend_rules`), in chunks and under a deadline.

Every rank of the world calls it (the collectives below run on every rank in the same order, so
the backend's sequence numbers stay equal and the next commit agrees):

1. the source (the lowest-numbered rank that did not join) broadcasts a header: a JSON
   manifest of every tensor it will send (name, dtype, shape), the optimizer's ``state_dict``
   with each tensor replaced by its index in the manifest (non-tensor values as JSON, never
   pickled), and the step to redo;
2. each receiver checks the manifest against its own module and optimizer (names, dtypes,
   shapes, parameter counts, a size bound) and every rank learns, in one all_reduce, who refused:
   on a refusal everyone stops there and nothing is copied anywhere;
3. the tensors' bytes go out in broadcasts of at most ``chunk_bytes``, each bounded by what is
   left of the deadline; receivers stage them, and only once every chunk has arrived copy them
   into the module's parameters and buffers and load the optimizer's state.

Every wait also ends as soon as a member's launcher reports it dead (the death notices,
:func:`~ncclguard.recovery.snapshots.exchange.run_watched`), not only at the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.backend_rules import BackendRules, rules_for
from ncclguard.deadlines import Deadline, to_seconds
from ncclguard.errors import HealFailed
from ncclguard.recovery.heal_header import (
    DEFAULT_CHUNK_BYTES,
    Header,
    check_header,
    dtype_of,
    make_header,
    module_tensors,
    nbytes,
)
from ncclguard.recovery.snapshots.exchange import Dead, death_watch, run_watched
from ncclguard.recovery.snapshots.keeper import side_group
from ncclguard.recovery.state_json import from_json
from ncclguard.results import Result
from ncclguard.store.codec import DecodeError, decode
from ncclguard.world import current_world

__all__ = ["DEFAULT_CHUNK_BYTES", "HealResult", "heal_from_peer"]

MAX_HEADER_BYTES = 64 * 1024 * 1024  # a manifest entry is ~100 bytes: room for ~600k tensors


@dataclass
class HealResult(Result):
    """One heal as this rank took part in it; truthy when every receiver has the source's state.

    Attributes:
        ok: the transfer completed and every receiver applied it (or there was nothing to heal).
        role: ``"source"``, ``"receiver"``, ``"bystander"`` (a live rank that relays nothing it
            keeps), or ``"none"`` (no rank joined: no communication).
        source: the rank that sent (None when nothing was healed).
        receivers: the ranks that received (sorted).
        step: the step the source said to run next (what a receiver redoes), or None.
        extra: on a receiver, what the source's ``extra`` held (tensors in place), or None.
        bytes: bytes of tensor data moved.
        chunks: broadcasts of tensor data.
        elapsed_s: seconds from entry to return.
        lane: the group the bytes went over: ``"world"`` (the world group, which carries CPU tensors:
            gloo) or ``"side gloo"`` (NCCL, and its stand-in: :mod:`ncclguard.backend_rules`); ``""``
            when nothing was sent.
        error: a :class:`~ncclguard.errors.HealFailed` when not ``ok``, else None.
    """

    ok: bool
    role: str
    source: int | None = None
    receivers: list[int] = field(default_factory=list)
    step: int | None = None
    extra: Any = None
    bytes: int = 0
    chunks: int = 0
    elapsed_s: float = 0.0
    lane: str = ""
    error: HealFailed | None = None


@dataclass(frozen=True)
class _Lane:
    """Where and how long the heal's collectives run.

    Attributes:
        group: the group they run on (None: the world group).
        rules: the world group's backend rules (the lane's check).
        deadline: the end of the whole transfer.
        dead: the members' death notices, which end a wait early.
    """

    group: dist.ProcessGroup | None
    rules: BackendRules
    deadline: Deadline
    dead: Dead

    def run(self, what: str, call: Any, t: torch.Tensor, **kw: Any) -> None:
        # Watched: a receiver that dies mid-heal fails the source's broadcast at once, but gloo leaves
        # another rank waiting on a live one up to the deadline (heal_timeout, 60 s by default); its
        # launcher's death notice ends that wait instead.
        if self.group is None:
            self.rules.check_carry(t, f"heal_from_peer, {what}")
        run_watched(what, partial(call, t, group=self.group, async_op=True, **kw), self.deadline, self.dead)


def _lane(rules: BackendRules, deadline: Deadline) -> _Lane:
    """The world group where it carries the heal's CPU tensors (gloo), else the world's side gloo
    group (NCCL, and its stand-in): the state is staged on the CPU either way.

    Raises:
        HealFailed: the side group could not be made (a member died before it).
    """
    group = None
    if not rules.carries_cpu:
        try:
            group = side_group().group
        except RuntimeError as exc:
            raise HealFailed(f"the side gloo group for the heal could not be made ({exc})") from exc
    return _Lane(group, rules, deadline, death_watch())


def _broadcast(t: torch.Tensor, src: int, lane: _Lane, what: str) -> None:
    lane.run(what, dist.broadcast, t, src=src)


def _pieces(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    for t in tensors:
        yield t.contiguous().reshape(-1).view(torch.uint8)


def heal_from_peer(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    receivers: list[int] | None = None,
    source: int | None = None,
    step: int | None = None,
    timeout: float | timedelta = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_bytes: int | None = None,
    extra: Any = None,
) -> HealResult:
    """Copies the module's parameters and buffers and the optimizer's state from a live rank to
    the ranks that joined at the last rebuild (restarted processes); call it on every rank.

    Call it right after :func:`ncclguard.rebuild_world` (survivors) and
    :func:`ncclguard.rejoin_world` (restarted processes), before wrapping the module in DDP.
    ``RecoveringStep(..., heal=True)`` does it on both sides.

    Args:
        module: the unwrapped model (the same architecture on every rank).
        optimizer: its optimizer, or None to heal the module alone.
        receivers: ranks that receive; default the current world's ``joined`` ranks (the same
            on every rank). Nothing to receive: returns at once, no communication.
        source: the rank that sends; default the lowest-numbered rank not receiving.
        step: on the source, the step the receivers should run next (they read it in
            :attr:`HealResult.step`); ignored elsewhere.
        timeout: seconds (or a timedelta) for the whole transfer.
        chunk_bytes: bytes of tensor data per broadcast, at most.
        max_bytes: a receiver refuses a transfer larger than this; default 8 times its own
            module's bytes plus 1 MiB (an optimizer such as Adam holds 2 to 3 times the module).
        extra: on the source, more state to send: tensors and JSON values (None, bool, int,
            float, str, lists, tuples, dicts), never pickled; receivers find it in
            :attr:`HealResult.extra` (a framework's adapter sends its trainer's state this way).

    Returns:
        A :class:`HealResult`, truthy when every receiver applied the source's state. Falsy with
        a :class:`~ncclguard.errors.HealFailed` when a receiver refused (nothing copied anywhere),
        a chunk missed the deadline, or the group failed: then the world group may be dead, and
        the ranks must rebuild.

    Raises:
        TypeError, ValueError: bad arguments, or no process group; raised before any communication.
    """
    timeout_s = _check_arguments(module, optimizer, chunk_bytes, timeout)
    rules = rules_for()  # a bad NCCLGUARD_NCCL_STAND_IN is refused here, before any communication
    size, me = dist.get_world_size(), dist.get_rank()
    wanted = _receivers(receivers, size)
    start = time.monotonic()
    if not wanted:
        return HealResult(True, "none")
    source = _source(source, wanted, size)
    role = "source" if me == source else "receiver" if me in wanted else "bystander"
    limit = (
        max_bytes
        if max_bytes is not None
        else 8 * sum(t.numel() * t.element_size() for _, t in module_tensors(module)) + (1 << 20)
    )
    result = HealResult(False, role, source, wanted)
    deadline = Deadline(start + timeout_s)
    try:
        lane = _lane(rules, deadline)
        result.lane = "world" if lane.group is None else "side gloo"
        _heal(module, optimizer, me, source, wanted, step, chunk_bytes, limit, lane, result, extra)
        result.ok = True
    except HealFailed as exc:
        result.error = exc
        log.error("heal_from_peer: %s", exc)
    result.elapsed_s = time.monotonic() - start
    if result.ok:
        _log_done(me, result)
    return result


def _log_done(me: int, result: HealResult) -> None:
    role = result.role
    log.warning(
        "heal_from_peer: rank %d %s, rank %d to ranks %s: %d bytes in %d chunks over the %s group, %.3f s",
        me,
        "sent" if role == "source" else "received" if role == "receiver" else "relayed",
        result.source,
        rank_ranges(result.receivers),
        result.bytes,
        result.chunks,
        result.lane,
        result.elapsed_s,
    )


def _check_arguments(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, chunk_bytes: int, timeout: float | timedelta
) -> float:
    """Refuses bad arguments, and a call without a process group, before any communication.

    Returns:
        The timeout in seconds.

    Raises:
        TypeError, ValueError: what :func:`heal_from_peer` raises for them.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"heal_from_peer needs the torch.nn.Module to heal, got {type(module).__name__}")
    if optimizer is not None and not callable(getattr(optimizer, "load_state_dict", None)):
        raise TypeError(
            f"optimizer must be a torch optimizer (state_dict/load_state_dict), got {type(optimizer).__name__}"
        )
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    timeout_s = to_seconds(timeout, "timeout")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("heal_from_peer runs on a process group: call it after rebuild_world / rejoin_world")
    return timeout_s


def _receivers(receivers: list[int] | None, size: int) -> list[int]:
    """The ranks that receive (sorted): ``receivers``, else the current world's restarted ones.

    Raises:
        ValueError: one is not a rank of this world of ``size``.
    """
    wanted = sorted(current_world().joined if receivers is None else set(receivers))
    if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size for r in wanted):
        raise ValueError(f"receivers must be ranks of this world of {size}, got {receivers!r}")
    return wanted


def _source(source: int | None, wanted: list[int], size: int) -> int:
    """The rank that sends: ``source``, else the lowest-numbered rank that does not receive.

    Raises:
        ValueError: every rank receives, or ``source`` is not a rank that does not receive.
    """
    if source is None:
        found = next((r for r in range(size) if r not in wanted), None)
        if found is None:
            raise ValueError(f"every rank of this world of {size} is a receiver: no live rank holds the state")
        return found
    if isinstance(source, bool) or not isinstance(source, int) or not 0 <= source < size or source in wanted:
        raise ValueError(f"source must be a rank of this world of {size} that does not receive, got {source!r}")
    return source


def _heal(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    me: int,
    source: int,
    receivers: list[int],
    step: int | None,
    chunk_bytes: int,
    limit: int,
    lane: _Lane,
    result: HealResult,
    extra: Any = None,
) -> None:
    """The transfer, on every rank: the header, who refuses, the bytes, and on a receiver their
    application (the module doc's three steps).

    Raises:
        HealFailed: the source sent nothing, a receiver refused, a collective failed or missed the
            deadline, or the state could not be applied.
    """
    header, sent = _exchange_header(module, optimizer, me, source, step, chunk_bytes, lane, extra)
    _stop_on_refusal(header, module, optimizer, me, source, receivers, limit, lane)
    result.step = header.step
    staged = _send_bytes(header, sent, me, source, me in receivers, lane, result)
    if me in receivers:
        _apply(module, optimizer, header, staged)
        if header.extra is not None:
            try:
                result.extra = from_json(header.extra, staged[header.module_tensors :])
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise HealFailed(f"the source's extra state cannot be read ({exc})") from exc


def _exchange_header(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    me: int,
    source: int,
    step: int | None,
    chunk_bytes: int,
    lane: _Lane,
    extra: Any,
) -> tuple[Header, list[torch.Tensor]]:
    """Step 1: the source's header, its length then its bytes. Every rank checks the length
    against the same bound; a header that cannot be read becomes an error every rank sees.

    Returns:
        The header, and on the source the tensors it sends (in the manifest's order).

    Raises:
        HealFailed: a broadcast failed, or the header is over its bound.
    """
    header: Header | None = None
    sent: list[torch.Tensor] = []
    raw = b""
    if me == source:
        try:
            header, sent = make_header(module, optimizer, step, chunk_bytes, extra)
        except HealFailed as exc:
            header = Header(error=str(exc)[:4096])
        raw = header.model_dump_json().encode()
    length = torch.tensor([len(raw) if me == source else 0], dtype=torch.int64)
    _broadcast(length, source, lane, "the header's length")
    n = int(length.item())
    if n > MAX_HEADER_BYTES:
        raise HealFailed(f"the source's header is {n} bytes, over the bound of {MAX_HEADER_BYTES}")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if me == source else torch.empty(n, dtype=torch.uint8)
    _broadcast(buf, source, lane, "the header")
    if header is None:
        try:
            header = decode(Header, bytes(buf.numpy()), "the heal's header", MAX_HEADER_BYTES)
        except DecodeError as exc:
            header = Header(error=f"(seen by rank {me}) {exc}")
    return header, sent


def _stop_on_refusal(
    header: Header,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    me: int,
    source: int,
    receivers: list[int],
    limit: int,
    lane: _Lane,
) -> None:
    """Step 2: who refuses, learnt in one all_reduce, so that every rank stops together before
    anything is copied.

    Raises:
        HealFailed: the source sends nothing, or a receiver refused.
    """
    refusal = check_header(header, module, optimizer, limit) if me in receivers else None
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    flags[me] = 1 if refusal is not None else 0
    lane.run("the receivers' answer", dist.all_reduce, flags)
    refused = [r for r in range(flags.numel()) if flags[r] != 0]
    if header.error is not None:
        raise HealFailed(f"the source (rank {source}) sends nothing: {header.error}")
    if refused:
        mine = f": {refusal}" if refusal is not None else ""
        who = f"rank {refused[0]}" if len(refused) == 1 else f"ranks {rank_ranges(refused)}"
        raise HealFailed(f"{who} refused the source's state{mine}", refused_ranks=refused)


def _send_bytes(
    header: Header,
    sent: list[torch.Tensor],
    me: int,
    source: int,
    receives: bool,
    lane: _Lane,
    result: HealResult,
) -> list[torch.Tensor]:
    """Step 3: the tensors' bytes, in broadcasts of at most the header's chunk size, each bounded
    by what is left of the deadline; counted in ``result`` (``bytes``, ``chunks``).

    Returns:
        On a receiver, the staged tensors (nothing is applied until all have arrived); else [].

    Raises:
        HealFailed: a broadcast failed or missed the deadline.
    """
    staged = [torch.empty(e.shape, dtype=dtype_of(e.dtype)) for e in header.tensors] if receives else []
    total = sum(nbytes(e) for e in header.tensors)
    chunk = torch.empty(min(header.chunk_bytes, max(total, 1)), dtype=torch.uint8)
    targets = [t.reshape(-1).view(torch.uint8) for t in staged]
    out_pieces = _pieces(sent) if me == source else iter(())
    src_piece, src_off = None, 0
    offset = 0
    while offset < total:
        size = min(chunk.numel(), total - offset)
        view = chunk[:size]
        if me == source:
            filled = 0
            while filled < size:
                if src_piece is None or src_off >= src_piece.numel():
                    src_piece, src_off = next(out_pieces), 0
                    continue
                take = min(size - filled, src_piece.numel() - src_off)
                view[filled : filled + take].copy_(src_piece[src_off : src_off + take])
                filled, src_off = filled + take, src_off + take
        _broadcast(view, source, lane, f"chunk {result.chunks} ({offset} of {total} bytes)")
        if receives:
            _scatter(view, offset, targets)
        offset += size
        result.chunks += 1
    result.bytes = total
    return staged


def _scatter(view: torch.Tensor, offset: int, targets: list[torch.Tensor]) -> None:
    """Copies one chunk (bytes ``offset..offset+len(view)`` of the stream) into the staged tensors."""
    pos = 0
    for t in targets:
        n = t.numel()
        lo, hi = max(offset, pos), min(offset + view.numel(), pos + n)
        if lo < hi:
            t[lo - pos : hi - pos].copy_(view[lo - offset : hi - offset])
        pos += n
        if pos >= offset + view.numel():
            break


def _apply(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, header: Header, staged: list[torch.Tensor]
) -> None:
    # The optimizer first: it is the part that can still refuse, and the module is untouched then.
    if optimizer is not None:
        try:
            state = from_json(header.optimizer, staged[header.module_tensors :])
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
            raise HealFailed(f"the optimizer's state could not be loaded ({type(exc).__name__}: {exc})") from exc
    own = module_tensors(module)
    with torch.no_grad():
        for (_, t), new in zip(own, staged[: header.module_tensors], strict=True):
            t.copy_(new)
