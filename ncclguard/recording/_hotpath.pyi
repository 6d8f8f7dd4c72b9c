"""Types of the compiled recording wrapper (ncclguard/recording/_hotpath.c)."""

from typing import Any

class Wrapper:
    """The compiled recording wrapper of one torch.distributed op (see instrument.py)."""

    __wrapped__: Any
    __ncclguard_original__: Any
    __signature__: Any

    def __init__(self, original: Any, kind: Any, spec: dict[str, Any], namespace: dict[str, Any]) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class Opener:
    """FlightRecorder.open_fast/close_ok compiled, for safe_all_reduce (see flight.py)."""

    def __init__(self, namespace: dict[str, Any]) -> None: ...
    def open(self, op: Any, group: str, numel: int, dtype: Any) -> list[Any] | None: ...
    def close(self, rec: list[Any] | None) -> None: ...
