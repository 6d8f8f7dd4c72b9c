"""Types of the compiled recording wrapper (ncclguard/recording/_hotpath.c)."""

from typing import Any

class Wrapper:
    """The compiled recording wrapper of one torch.distributed op (see instrument.py)."""

    __wrapped__: Any
    __ncclguard_original__: Any
    __signature__: Any

    def __init__(self, original: Any, kind: Any, spec: dict[str, Any], namespace: dict[str, Any]) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
