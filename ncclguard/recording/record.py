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

from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch

from ncclguard._naming import REDUCE_OP_NAMES, dtype_name
from ncclguard.recording.sites import code_site

__all__ = ["FlightRecord", "OpKind", "Raw", "seq_key"]

# The slots of a raw record (a list). Keep new_raw(), FlightRecord, instrument._BODY and
# _hotpath.c's R_* in step.
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
        """The op's name with its reduction.

        Args:
            redop: the call's ``ReduceOp``; None reads as torch's default, SUM.

        Returns:
            ``"all_reduce(MAX)"``; the bare name for an op without a reduction, or with a
            ``ReduceOp`` it does not know (a premultiplied sum).
        """
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
    """The counter a record is numbered in.

    Args:
        group: the group's name.
        p2p: a point-to-point op (send/recv).

    Returns:
        ``group``, or ``"<group>:p2p"`` for a point-to-point op.
    """
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

    Returns:
        The record: a list of ``SLOTS`` items, the last four (``ERROR`` to ``PREV``) None.
    """
    return [seq, op, None, group, numel, dtype, start, None, phase, where, lasti, thread, async_op, peer] + [None] * 4


T = TypeVar("T")


class _Slot(property, Generic[T]):
    """A FlightRecord field over one slot of its raw record: a read converts what the hot path
    stored (``read``; None: as stored), a write stores the value as given (none when not ``writable``).

    A property underneath, its getter and setter closures over the slot: a read is one Python call,
    as with the hand-written properties these replaced (a Python ``__get__`` would add another),
    and the closure's cells cost it ~10 ns more, on the read side only (the hot path writes the
    list, never through here). The ``TYPE_CHECKING`` declarations give type checkers each field's type.
    """

    def __init__(self, index: int, read: Callable[[Any], T] | None = None, writable: bool = True) -> None:
        if read is None:

            def get(view: FlightRecord) -> T:
                value: T = view._r[index]
                return value

        else:

            def get(view: FlightRecord) -> T:
                return read(view._r[index])

        def put(view: FlightRecord, value: T) -> None:
            view._r[index] = value

        super().__init__(get, put if writable else None)

    if TYPE_CHECKING:  # property's own __get__ is typed Any: these give each field its type

        @overload
        def __get__(self, instance: None, owner: type | None = None, /) -> _Slot[T]: ...
        @overload
        def __get__(self, instance: object, owner: type | None = None, /) -> T: ...
        def __get__(self, instance: object, owner: type | None = None, /) -> Any: ...
        def __set__(self, instance: object, value: T, /) -> None: ...


def _progress_part(k: int) -> Callable[[Any], int]:
    """Reads part ``k`` of a record's PROGRESS tuple (chunks done, chunks, bytes done); 0 before any."""

    def read(progress: Any) -> int:
        return 0 if progress is None else int(progress[k])

    return read


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

    Raises:
        ValueError: a ``state`` other than started, completed or failed.
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
        """The view of a raw record.

        Args:
            raw: a record the recorder (or :func:`new_raw`) made.

        Returns:
            A view that reads ``raw`` as it changes (no copy).
        """
        view = object.__new__(cls)
        view._r = raw
        return view

    # The fields that read one slot, each declared once: its slot and how a read converts it.
    seq = _Slot(SEQ, int)
    group = _Slot(GROUP, str)
    numel = _Slot(NUMEL, int)
    start = _Slot(START, float)
    end: _Slot[float | None] = _Slot(END)
    phase = _Slot(PHASE, str)
    async_op = _Slot(ASYNC, bool)
    peer: _Slot[int | None] = _Slot(PEER)
    thread = _Slot(THREAD, int)
    # A chunked call's progress: one tuple in one slot, read only (the recorder writes it).
    chunks_done = _Slot(PROGRESS, _progress_part(0), writable=False)
    chunks = _Slot(PROGRESS, _progress_part(1), writable=False)
    bytes_done = _Slot(PROGRESS, _progress_part(2), writable=False)

    # The fields with more to them: the op's name from its kind and ReduceOp, the dtype's name
    # (written out: a converter function would cost a read one more call), the state from END and
    # ERROR, the site from the frame's code and offset.
    @property
    def op(self) -> str:
        r = self._r
        op = r[OP]
        return op if type(op) is str else op.label(r[REDOP])

    @op.setter
    def op(self, value: str) -> None:
        self._r[OP], self._r[REDOP] = value, None

    @property
    def dtype(self) -> str:
        d = self._r[DTYPE]
        return dtype_name(d) if isinstance(d, torch.dtype) else str(d)

    @dtype.setter
    def dtype(self, value: str) -> None:
        self._r[DTYPE] = value

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

    def __repr__(self) -> str:
        return f"FlightRecord({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlightRecord) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data, read at one moment.

        Returns:
            Every attribute above, by name, as JSON types (the Work handle left out).
        """
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
