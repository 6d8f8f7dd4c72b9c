"""What slim_outputs saves: bytes a forward returns and peak tensor memory, with and without it.

Usage (CPU, a few minutes for the mid-size config on 2 cores):

    .venv/bin/python benchmarks/investigations/slim_outputs_memory.py                   # tiny and mid
    .venv/bin/python benchmarks/investigations/slim_outputs_memory.py --configs tiny    # seconds

The model is ncclguard's Qwen2.5-VL classifier with ``config.output_hidden_states=True`` (a
config that asks for hidden states, so the unslimmed forward returns them) on a synthetic batch
of images and text. "slimmed" is the same model after ``slim_outputs(model)``. For each, in eval
mode (``torch.no_grad``) and in training mode (autograd on, forward only):

- returned: bytes of all tensors in the output (unique storages);
- peak: the most tensor bytes alive at once during the forward, parameters included, counted
  by ``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode that follows
  every tensor storage; it works on CPU); "peak - params" takes the parameters off;
- held: tensor bytes alive right after the forward while the caller holds the output.

Results go to benchmarks/results/slim_outputs_memory.json and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.distributed._tools.mem_tracker import MemTracker

# The synthetic Qwen2.5-VL data and the reference trainer are test fixtures (tests/workers).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "workers"))

from qwen2_5_vl_synthetic import image_tokens, mid_config, synthetic_batch, tiny_config

from ncclguard.integrations.models.qwen2_5_vl import Qwen2_5_VLForClassification, slim_outputs, unslim_outputs

RESULTS = Path(__file__).resolve().parent.parent / "results" / "slim_outputs_memory.json"
# (config, batch, filler text tokens, image grid in patches): sequence = text + image tokens + 5.
SETUPS: dict[str, dict[str, Any]] = {
    "tiny": {"config": tiny_config, "batch": 8, "text": 187, "grid": (1, 16, 16)},
    "mid": {"config": mid_config, "batch": 4, "text": 443, "grid": (1, 16, 16)},
}
# Qwen2.5-VL-7B as the seeds ran it: hidden states are (layers + 1) tensors of batch x seq x hidden.
SEVEN_B = {"layers": 28, "hidden": 3584, "batch": 8, "seq": 2048}


def output_bytes(output: Any) -> int:
    """Bytes of the distinct tensor storages reachable from a model output."""
    seen: dict[int, int] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(dict(output.items()) if hasattr(output, "items") else output)
    return sum(seen.values())


def measure(model: torch.nn.Module, batch: dict[str, torch.Tensor], train: bool) -> dict[str, Any]:
    """One forward under MemTracker; returns byte counts and the wall time."""
    model.train(train)
    tracker = MemTracker()
    tracker.track_external(model)
    start = time.perf_counter()
    with tracker:
        with torch.set_grad_enabled(train):
            out = model(**batch)
        held = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    result = {
        "returned": output_bytes(out),
        "peak": peak,
        "held": held,
        "forward_s": round(seconds, 2),
        "hidden_states": len(out.hidden_states) if out.hidden_states is not None else 0,
    }
    del out
    return result


def run_setup(name: str) -> dict[str, Any]:
    setup = SETUPS[name]
    torch.manual_seed(0)
    cfg = setup["config"]()
    model = Qwen2_5_VLForClassification(cfg)
    model.config.output_hidden_states = True
    text = (setup["text"], setup["text"])
    batch = synthetic_batch(cfg, setup["batch"], seed=1, text_len=text, grid_thw=setup["grid"])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tc = cfg.text_config
    row: dict[str, Any] = {
        "config": name,
        "layers": tc.num_hidden_layers,
        "hidden": tc.hidden_size,
        "batch": setup["batch"],
        "seq": int(batch["input_ids"].shape[1]),
        "image_tokens": image_tokens(cfg, setup["grid"]),
        "parameters": sum(p.numel() for p in model.parameters()),
        "param_bytes": params,
        "runs": {},
    }
    for mode, train in (("eval", False), ("train", True)):
        for variant in ("unslimmed", "slimmed"):
            (slim_outputs if variant == "slimmed" else unslim_outputs)(model)
            r = measure(model, batch, train)
            r["peak_minus_params"] = r["peak"] - params
            row["runs"][f"{mode}/{variant}"] = r
    # What the arithmetic predicts for the hidden states alone: (layers + 1) x batch x seq x hidden x 4 bytes.
    row["predicted_hidden_bytes"] = (row["layers"] + 1) * row["batch"] * row["seq"] * row["hidden"] * 4
    return row


def seven_b() -> dict[str, Any]:
    s = SEVEN_B
    per_tensor = s["batch"] * s["seq"] * s["hidden"]
    total = (s["layers"] + 1) * per_tensor
    return {
        **s,
        "elements_per_tensor": per_tensor,
        "tensors": s["layers"] + 1,
        "elements": total,
        "bytes_bf16": total * 2,
        "bytes_fp32": total * 4,
    }


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure what slim_outputs saves (CPU).")
    parser.add_argument("--configs", nargs="+", default=["tiny", "mid"], choices=sorted(SETUPS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    console = Console(width=150)
    rows = []
    for name in args.configs:
        console.print(f"measuring {name} ...")
        rows.append(run_setup(name))
    doc = {
        "command": "benchmarks/investigations/slim_outputs_memory.py --configs " + " ".join(args.configs),
        "machine": {
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "dtype": "float32",
        "setups": rows,
        "qwen2_5_vl_7b_arithmetic": seven_b(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")

    table = Table(title="slim_outputs: one forward, float32, CPU (MB = 1e6 bytes)")
    for col in (
        "config",
        "B x S x H, layers",
        "mode",
        "variant",
        "returned MB",
        "peak MB",
        "peak - params MB",
        "held MB",
        "forward s",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        shape = f"{row['batch']} x {row['seq']} x {row['hidden']}, {row['layers']}"
        for key, r in row["runs"].items():
            mode, variant = key.split("/")
            table.add_row(
                row["config"],
                shape,
                mode,
                variant,
                mb(r["returned"]),
                mb(r["peak"]),
                mb(r["peak_minus_params"]),
                mb(r["held"]),
                f"{r['forward_s']:.2f}",
            )
    console.print(table)
    s = doc["qwen2_5_vl_7b_arithmetic"]
    console.print(
        f"Qwen2.5-VL-7B: {s['tensors']} tensors x {s['batch']} x {s['seq']} x {s['hidden']} = {s['elements']:,} "
        f"elements = {mb(s['bytes_bf16'])} MB in bf16, {mb(s['bytes_fp32'])} MB in fp32 per rank per forward"
    )
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
