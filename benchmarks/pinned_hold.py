"""How much pinned host memory snapshot buffers hold, by the way they are pinned (issue 59; needs a GPU).

    python benchmarks/pinned_hold.py [--bytes 1611017088] [--takes 4] [--json out.json]

A snapshot's payload is a pinned host buffer a GPU copies into. Two ways to get one, side by side:

- ``caching``: ``torch.empty(n, dtype=torch.uint8, pin_memory=True)`` (what the keeper does), one new
  buffer per take and the one before it dropped, as takes with ``snapshot_keep=1`` do: torch's caching
  host allocator rounds each block up (to a power of two) and keeps freed blocks for reuse;
- ``registered``: a plain (pageable) buffer of exactly ``n`` bytes pinned in place with
  ``cudaHostRegister`` (``torch.cuda.cudart().cudaHostRegister``), unregistered when dropped.

Reported for each: the caching host allocator's counters after the takes
(``torch.cuda.host_memory_stats``, where this torch has it), the process's resident memory, and the
device-to-host copy rate of ``n`` bytes into the buffer (GB/s, the median of ``--takes`` copies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch


def _stats() -> dict[str, int]:
    get = getattr(torch.cuda, "host_memory_stats", None)
    if get is None:
        return {}
    return {k: int(v) for k, v in get().items() if "bytes" in k and k.endswith(".current")}


def _copy_rate(src: torch.Tensor, dst: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() / (time.perf_counter() - t0) / 1e9


def caching(n: int, takes: int, src: torch.Tensor) -> dict[str, Any]:
    rates, held = [], None
    for _ in range(takes):
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        rates.append(_copy_rate(src, buf))
        held = buf  # the take before is dropped: keep=1
        del buf
    out = {"gb_s": statistics.median(rates), "allocator": _stats(), "rss": psutil.Process().memory_info().rss}
    del held
    return out


def registered(n: int, takes: int, src: torch.Tensor) -> dict[str, Any]:
    cudart = torch.cuda.cudart()
    rates, held = [], None
    for _ in range(takes):
        buf = torch.empty(n, dtype=torch.uint8)
        err = cudart.cudaHostRegister(buf.data_ptr(), n, 0)
        if int(err) != 0:
            return {"error": f"cudaHostRegister returned {err}"}
        rates.append(_copy_rate(src, buf))
        if held is not None:
            cudart.cudaHostUnregister(held.data_ptr())
        held = buf
    out = {"gb_s": statistics.median(rates), "allocator": _stats(), "rss": psutil.Process().memory_info().rss}
    if held is not None:
        cudart.cudaHostUnregister(held.data_ptr())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bytes", type=int, default=1_611_017_088, help="a snapshot's payload (the default: 134M params + Adam)"
    )
    ap.add_argument("--takes", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pinned_hold: no CUDA GPU here; nothing run")
        return 2
    src = torch.ones(args.bytes, dtype=torch.uint8, device="cuda")
    doc: dict[str, Any] = {"bytes": args.bytes, "takes": args.takes, "card": torch.cuda.get_device_name(0)}
    doc["before"] = {"allocator": _stats(), "rss": psutil.Process().memory_info().rss}
    doc["registered"] = registered(args.bytes, args.takes, src)  # first: the caching one keeps its blocks
    doc["caching"] = caching(args.bytes, args.takes, src)
    doc["command"] = " ".join(["python", "benchmarks/pinned_hold.py", *sys.argv[1:]])
    print("pinned_hold:", json.dumps(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
