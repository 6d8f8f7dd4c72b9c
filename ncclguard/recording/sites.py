"""Where a call came from: the user's frame above the frameworks, and its ``file:line``.

The flight recorder, the snapshot of a rank's stacks and the reports name the line of user code
that issued a collective: the first frame outside torch, DeepSpeed, transformers, Accelerate,
contextlib, threading, inductor's generated code and ncclguard itself (its CLI and benchmark
ranks excepted: they are applications). A frame is kept as its code object and instruction
offset and becomes ``file:line`` only when read (:func:`code_site`), because ``f_lineno`` costs
more than the whole walk.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import sys
import tempfile
import threading
import traceback
from types import CodeType, FrameType

__all__ = ["call_site", "code_site", "format_stack", "frame_site", "user_files", "user_frame"]

# Frames from these packages are skipped when looking for the user's call site. Prefixes are
# the packages' real directories, so a checkout that happens to be named "ncclguard" still counts.
_FRAMEWORKS = ("torch", "deepspeed", "transformers", "accelerate")
# The ncclguard package, every subpackage of it (this file is in ncclguard/recording/).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ncclguard's own applications (the demo, the benchmark ranks) are user code, not library frames.
_APP_DIRS = tuple(os.path.join(_PACKAGE_DIR, d, "") for d in ("cli", "bench"))
_THREADING = threading.__file__


def _inductor_cache_dir() -> str:
    """Where torch.compile's inductor writes the code it generates (its frames are torch's, not
    the user's): ``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>`` as inductor's
    ``default_cache_dir`` builds it."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


_INDUCTOR_CACHE = _inductor_cache_dir()
# (len(sys.modules) when computed, the prefixes); a one-element list so it is replaced, not rebound.
_skip_prefixes_cache: list[tuple[int, tuple[str, ...]]] = [(-1, ())]
# co_filename -> "is this a framework file?"; filenames are few, so the cache stays small.
_is_framework: dict[str, bool] = {}
# The files found to be the user's: the recording wrappers' first test of their caller's frame (a
# set's ``in``, no call), before the walk. Emptied with _is_framework when the frameworks change.
user_files: set[str] = set()


def _skip_prefixes() -> tuple[str, ...]:
    # Frameworks imported later (deepspeed after ncclguard) change the answer; len(sys.modules)
    # is a cheap "did anything get imported" check.
    if _skip_prefixes_cache[0][0] != len(sys.modules):
        dirs = [_PACKAGE_DIR, contextlib.__file__, _THREADING, _INDUCTOR_CACHE]
        # ncclguard.integrations lives outside the package directory in a source checkout
        # (setuptools package-dir maps the top-level integrations/ into it).
        integrations = getattr(sys.modules.get("ncclguard.integrations"), "__file__", None)
        if integrations:
            dirs.append(os.path.dirname(os.path.realpath(integrations)))
        for name in _FRAMEWORKS:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None) if module is not None else None
            if path:
                dirs.append(os.path.dirname(path))
        # typing_extensions' @deprecated wrapper stands between torch's deprecated collectives
        # (all_gather_into_tensor, which DeepSpeed calls) and their caller: a file, not a package.
        wrapper = getattr(sys.modules.get("typing_extensions"), "__file__", None)
        if wrapper:
            dirs.append(wrapper)
        prefixes = tuple(d if d.endswith(".py") else os.path.join(d, "") for d in dirs)
        if prefixes != _skip_prefixes_cache[0][1]:
            _is_framework.clear()
            user_files.clear()
        _skip_prefixes_cache[0] = (len(sys.modules), prefixes)
    return _skip_prefixes_cache[0][1]


def user_frame(frame: FrameType | None) -> FrameType | None:
    """``frame`` or the first frame above it outside torch, deepspeed, transformers, accelerate
    and ncclguard; None when there is none."""
    cache = _skip_prefixes_cache[0]
    prefixes = cache[1] if cache[0] == len(sys.modules) else _skip_prefixes()
    known = _is_framework
    while frame is not None:
        path = frame.f_code.co_filename
        skip = known.get(path)
        if skip is None:
            skip = known[path] = (path.startswith(prefixes) and not path.startswith(_APP_DIRS)) or path.startswith("<")
        if not skip:
            user_files.add(path)
            return frame
        frame = frame.f_back
    return None


# (code, offset) -> "file:line": a program issues its collectives from a few sites.
_sites: dict[tuple[CodeType, int], str] = {}


def code_site(code: CodeType, lasti: int) -> str:
    """``file:line`` of the instruction at byte offset ``lasti`` of ``code`` (a frame's
    ``f_code`` and ``f_lasti``): the line ``f_lineno`` gives while the frame is there."""
    key = (code, lasti)
    site = _sites.get(key)
    if site is None:
        line = code.co_firstlineno
        for begin, end, at in code.co_lines():
            if begin <= lasti < end:
                if at is not None:
                    line = at
                break
        site = f"{code.co_filename}:{line}"
        if len(_sites) < 4096:  # generated code could make sites without end; the cache stays bounded
            _sites[key] = site
    return site


def frame_site(frame: FrameType | None) -> str:
    """``file:line`` of ``frame`` or the first frame above it outside torch, deepspeed,
    transformers, accelerate and ncclguard; ``"?"`` when there is none."""
    frame = user_frame(frame)
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def call_site(skip: int = 2) -> str:
    """``file:line`` of the caller's first frame outside the frameworks and ncclguard.

    Args:
        skip: frames to skip from here (1: the caller of ``call_site``).
    """
    return frame_site(sys._getframe(skip))


def format_stack(frame: FrameType | None, limit: int = 40) -> list[str]:
    """The stack of ``frame``, outermost first, as ``"file:line in func: code"`` lines (the
    innermost ``limit``)."""
    if frame is None:
        return []
    summary = traceback.extract_stack(frame, limit=limit)
    return [f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "") for f in summary]
