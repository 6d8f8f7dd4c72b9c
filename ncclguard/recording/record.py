"""One flight record: a plain list written once on the collective's path, read as a FlightRecord.

The hot path (``instrument()``'s wrappers, ``safe_all_reduce``) writes a record as one Python list
built in one step (``[seq, op, ...]``: one allocation, no attribute writes) and keeps in it what
it has at hand, unformatted: the op's kind and the ``ReduceOp`` object, the ``torch.dtype``, the
user frame's code object and instruction offset. Everything a report shows is derived from these
only when a record is read, through :class:`FlightRecord`, a view over the list. Reading costs a
little more than it did; writing, which happens on every collective, costs a fraction.

After the list is published (appended to the recorder's ring), only three of its slots change, each
by one store: ``ERROR`` (a failure's text), then ``END`` (the end time, which publishes the
outcome), and ``PROGRESS`` (a chunked call's ``(chunks_done, chunks, bytes_done)``, one tuple, so a
reader never sees its parts from two different moments); ``WORK`` and ``PREV`` are the recorder's
own bookkeeping. See :mod:`ncclguard.recording.flight` for who writes what, and why a reader on
another thread always sees a whole record.
"""

from __future__ import annotations

from types import CodeType
from typing import Any

import torch

from ncclguard._naming import REDUCE_OP_NAMES, dtype_name
from ncclguard.recording.sites import code_site

__all__ = ["FlightRecord", "OpKind", "Raw", "seq_key"]

# The slots of a raw record (a list). Keep new_raw(), FlightRecord and instrument._BODY in step.
SEQ, OP, REDOP, GROUP, NUMEL, DTYPE, START, END, PHASE, WHERE, LASTI, THREAD, ASYNC, PEER = range(14)
ERROR, PROGRESS, WORK, PREV = range(14, 18)
SLOTS = 18

Raw = list[Any]  # a raw record; see the slots above


class OpKind:
    """What a wrapped op is called, kept in its records instead of a formatted name.

    Args:
        name: the op's name, e.g. ``"all_reduce"``.
        reduces: the op takes a ``ReduceOp`` (its records are named ``"all_reduce(SUM)"``).
    """

    __slots__ = ("name", "reduces")

    def __init__(self, name: str, reduces: bool) -> None:
        self.name = name
        self.reduces = reduces

    def __repr__(self) -> str:
        return f"OpKind({self.name!r}, reduces={self.reduces})"

    def label(self, redop: Any) -> str:
        """``"all_reduce(MAX)"`` for ``redop``; the bare name for an op without one, or with a
        ``ReduceOp`` it does not know (a premultiplied sum); ``None`` reads as torch's default, SUM."""
        if not self.reduces:
            return self.name
        if redop is None:
            return f"{self.name}(SUM)"
        try:
            text = REDUCE_OP_NAMES.get(redop)
        except TypeError:  # a premultiplied-sum op object (unhashable)
            text = None
        return self.name if text is None else f"{self.name}({text})"


def seq_key(group: str, p2p: bool) -> str:
    """The counter a record is numbered in: the group, or ``"<group>:p2p"`` for send/recv."""
    return f"{group}:p2p" if p2p else group


def new_raw(
    seq: int,
    op: str | OpKind,
    group: str,
    numel: int,
    dtype: Any,
    start: float,
    phase: str,
    where: CodeType | str | None,
    lasti: int,
    thread: int,
    async_op: Any,
    peer: int | None,
) -> Raw:
    """A raw record of an op just issued (the generated wrappers build the same list inline).

    Args:
        seq: its number in its counter.
        op: its name, or its :class:`OpKind` (then ``REDOP`` names the reduction).
        group: the group's name.
        numel: elements moved.
        dtype: a ``torch.dtype`` or its name (``""``: no tensor).
        start: ``time.time()`` at issue.
        phase: the issuing thread's phase path.
        where: the user frame's code object (with ``lasti``), the site's text, or None (``"?"``).
        lasti: the instruction offset in ``where``'s code.
        thread: the issuing thread's ident.
        async_op: truthy when the caller does not block in the op.
        peer: the other rank of a point-to-point op, else None.
    """
    return [seq, op, None, group, numel, dtype, start, None, phase, where, lasti, thread, async_op, peer] + [None] * 4


class FlightRecord:
    """One collective as this rank saw it: a view over a raw record, read live.

    Attributes:
        seq: its number in ``group`` (point-to-point ops: in ``"<group>:p2p"``), from 1.
        op: the operation, e.g. ``"all_reduce(SUM)"`` or ``"broadcast"``.
        group: the process group's name (``"0"`` is the world group).
        numel: elements of the input tensor(s); 0 for a barrier.
        dtype: e.g. ``"float32"``; ``""`` without a tensor.
        start: ``time.time()`` when it was issued.
        state: ``started``, ``completed`` or ``failed`` (from ``end`` and ``error``).
        end: ``time.time()`` when it finished (async ops: when the completion was noticed).
        phase: the issuing thread's phase path.
        site: the user's ``file:line`` that issued it (from the frame's code and offset, on read).
        error: the failure, as text.
        async_op: issued with ``async_op=True`` (or isend/irecv): the caller did not block in it.
        peer: the other rank of a send/recv.
        thread: ``threading.get_ident()`` of the issuing thread.
        chunks_done: chunks of a chunked call completed so far (0: not chunked, or none yet).
        chunks: chunks of the call (0 until the first chunk completes).
        bytes_done: bytes of the call reduced so far.

    Made with the arguments of the record it describes (a test's, a report's), or by the recorder
    around its own records (:meth:`of`). Two views of one record read the same values.
    """

    __slots__ = ("_r",)

    def __init__(
        self,
        seq: int,
        op: str,
        group: str,
        numel: int,
        dtype: str,
        start: float,
        state: str = "started",
        end: float | None = None,
        phase: str = "",
        site: str | None = "",
        error: str | None = None,
        async_op: bool = False,
        peer: int | None = None,
        thread: int = 0,
        code: CodeType | None = None,
        lasti: int = -1,
    ) -> None:
        if state not in ("started", "completed", "failed"):
            raise ValueError(f"a record's state is started, completed or failed, got {state!r}")
        where: CodeType | str | None = code if code is not None else site
        r = new_raw(seq, op, group, numel, dtype, start, phase, where, lasti, thread, async_op, peer)
        # The state is what end and error say: a finished record has an end, a failed one an error.
        if state != "started":
            r[ERROR] = error if state == "failed" else None
            if state == "failed" and not error:
                r[ERROR] = "failed"
            r[END] = start if end is None else end
        self._r = r

    @classmethod
    def of(cls, raw: Raw) -> FlightRecord:
        """The view of a raw record (no copy: it reads the record as it changes)."""
        view = object.__new__(cls)
        view._r = raw
        return view

    @property
    def seq(self) -> int:
        return int(self._r[SEQ])

    @seq.setter
    def seq(self, value: int) -> None:
        self._r[SEQ] = value

    @property
    def op(self) -> str:
        r = self._r
        op = r[OP]
        return op if type(op) is str else op.label(r[REDOP])

    @op.setter
    def op(self, value: str) -> None:
        self._r[OP], self._r[REDOP] = value, None

    @property
    def group(self) -> str:
        return str(self._r[GROUP])

    @group.setter
    def group(self, value: str) -> None:
        self._r[GROUP] = value

    @property
    def numel(self) -> int:
        return int(self._r[NUMEL])

    @numel.setter
    def numel(self, value: int) -> None:
        self._r[NUMEL] = value

    @property
    def dtype(self) -> str:
        d = self._r[DTYPE]
        return dtype_name(d) if isinstance(d, torch.dtype) else str(d)

    @dtype.setter
    def dtype(self, value: str) -> None:
        self._r[DTYPE] = value

    @property
    def start(self) -> float:
        return float(self._r[START])

    @start.setter
    def start(self, value: float) -> None:
        self._r[START] = value

    @property
    def end(self) -> float | None:
        end: float | None = self._r[END]
        return end

    @end.setter
    def end(self, value: float | None) -> None:
        self._r[END] = value

    @property
    def state(self) -> str:
        r = self._r
        if r[END] is None:  # END is written last: once it is there, ERROR is final
            return "started"
        return "failed" if r[ERROR] is not None else "completed"

    @state.setter
    def state(self, value: str) -> None:
        # The state is what END and ERROR say; setting it sets them (a finished record gets an end).
        r = self._r
        if value == "started":
            r[END] = None
        elif value in ("completed", "failed"):
            r[ERROR] = None if value == "completed" else (r[ERROR] or "failed")
            if r[END] is None:
                r[END] = r[START]
        else:
            raise ValueError(f"a record's state is started, completed or failed, got {value!r}")

    @property
    def error(self) -> str | None:
        r = self._r
        return r[ERROR] if r[END] is not None else None

    @error.setter
    def error(self, value: str | None) -> None:
        self._r[ERROR] = value

    @property
    def phase(self) -> str:
        return str(self._r[PHASE])

    @phase.setter
    def phase(self, value: str) -> None:
        self._r[PHASE] = value

    @property
    def site(self) -> str:
        """The user's ``file:line`` that issued the op, ``"?"`` without one."""
        where = self._r[WHERE]
        if where is None or where == "":
            return "?" if where is None else ""
        if type(where) is str:
            return where
        return code_site(where, self._r[LASTI])

    @site.setter
    def site(self, value: str) -> None:
        self._r[WHERE] = value

    @property
    def async_op(self) -> bool:
        return bool(self._r[ASYNC])

    @async_op.setter
    def async_op(self, value: bool) -> None:
        self._r[ASYNC] = value

    @property
    def peer(self) -> int | None:
        peer: int | None = self._r[PEER]
        return peer

    @peer.setter
    def peer(self, value: int | None) -> None:
        self._r[PEER] = value

    @property
    def thread(self) -> int:
        return int(self._r[THREAD])

    @thread.setter
    def thread(self, value: int) -> None:
        self._r[THREAD] = value

    @property
    def chunks_done(self) -> int:
        p = self._r[PROGRESS]
        return 0 if p is None else int(p[0])

    @property
    def chunks(self) -> int:
        p = self._r[PROGRESS]
        return 0 if p is None else int(p[1])

    @property
    def bytes_done(self) -> int:
        p = self._r[PROGRESS]
        return 0 if p is None else int(p[2])

    def __repr__(self) -> str:
        return f"FlightRecord({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlightRecord) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON data, read at one moment (without the Work handle)."""
        r = self._r
        end = r[END]  # first: a failure's ERROR is written before its END
        error = r[ERROR] if end is not None else None
        progress = r[PROGRESS] or (0, 0, 0)  # one tuple: its three numbers are of one moment
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group,
            "numel": self.numel,
            "dtype": self.dtype,
            "start": self.start,
            "state": "started" if end is None else ("failed" if error is not None else "completed"),
            "end": end,
            "phase": self.phase,
            "site": self.site,
            "error": error,
            "async_op": self.async_op,
            "peer": self.peer,
            "thread": self.thread,
            "bytes_done": int(progress[2]),
            "chunks_done": int(progress[0]),
            "chunks": int(progress[1]),
        }
