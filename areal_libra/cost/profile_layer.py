"""The layer profile of `python -m areal_libra.cost.profile` (--device cuda, --layer, or --table): measure one
layer at the target shape (cost.layer_bench) or read a measured table, fit per-layer figures
(cost.layer_fit), and write the preset only if the fit is within its tolerances."""

from __future__ import annotations

import argparse
import json
import sys

from areal_libra.cost.layer_bench import LayerShape, measure_layer
from areal_libra.cost.layer_fit import TableError, fit_table, load_table, preset_yaml
from areal_libra.cost.presets import PresetError, load_hardware, load_model
from areal_libra.utils import atomic_write_text

# What is timed: the H200 reference's sweep on a GPU; a few small points on CPU (seconds).
CUDA_SWEEP = {"decode": [(b, c) for c in (1024, 8192) for b in (1, 16, 64, 256)],
              "prefill": [1024, 4096, 16384], "train": [4096]}
CPU_SWEEP = {"decode": [(b, c) for c in (64, 256) for b in (1, 4, 16, 32)], "prefill": [64, 128, 256],
             "train": [128]}


def _shape(args: argparse.Namespace) -> LayerShape:
    if args.shape:
        try:
            vals = [int(v) for v in args.shape.split(",")]
        except ValueError:
            raise ValueError(f"--shape {args.shape!r}: expected five integers HIDDEN,HEADS,KV_HEADS,HEAD_DIM,FFN") from None
        if len(vals) != 5 or min(vals) < 1 or vals[1] % vals[2]:
            raise ValueError(f"--shape {args.shape!r}: expected five positive integers, HEADS a multiple of KV_HEADS")
        return LayerShape(*vals)
    return LayerShape.of_model(load_model(args.model))


def _start_preset(args: argparse.Namespace, table: dict | None) -> str:
    if args.hardware:
        return args.hardware
    gpu = str((table or {}).get("gpu", "")).lower()
    for known in ("h200", "h100", "a800", "a100"):
        if known in gpu:
            return known
    return "cpu" if args.device == "cpu" else "h100"


def main_layer(args: argparse.Namespace) -> int:
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    try:
        if args.table:
            table = load_table(args.table)
            source = f"--table {args.table}"
        else:
            import torch

            if args.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("--device cuda but no CUDA device is available")
            if args.device == "cpu":
                torch.set_num_threads(max(1, args.threads))
            shape = _shape(args)
            sweep = CUDA_SWEEP if args.device == "cuda" else CPU_SWEEP
            if args.quick:
                sweep = {k: v[: max(2, len(v) // 2)] for k, v in sweep.items()}
            table = measure_layer(shape, args.device, sweep["decode"], sweep["prefill"], sweep["train"],
                                  repeat=3 if args.quick else 5, iters=3 if args.device == "cpu" else 20, log=log)
            source = f"measured on {table['gpu']} ({args.device}, {table['dtype']}, layer {args.shape or args.model})"
            if args.save_table:
                atomic_write_text(args.save_table, json.dumps(table, indent=1) + "\n")
        start = load_hardware(_start_preset(args, table))
        fit = fit_table(table, start, args.name)
    except (TableError, PresetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    worst = fit.worst()
    report = {"hardware": fit.hardware.name, "start": start.name, "source": source,
              "max_rel_error": {k: round(v, 4) for k, v in worst.items()},
              "rows": [{k: (round(v, 9) if isinstance(v, float) else v) for k, v in r.items()} for r in fit.rows]}
    problem = fit.check()
    if problem is not None:
        if args.json:
            print(json.dumps(report | {"refused": problem}))
        print(f"error: {problem}; not writing a calibration", file=sys.stderr)
        return 2
    header = (f"{fit.hardware.name}: per-layer figures fitted by python -m areal_libra.cost.profile {source}\n"
              f"start preset {start.name}; worst relative error: "
              + ", ".join(f"{k} {v:.1%}" for k, v in sorted(worst.items())))
    text = preset_yaml(fit.hardware, header)
    if args.out:
        atomic_write_text(args.out, text)
    if args.json:
        print(json.dumps(report))
    else:
        if not args.out:
            print(text, end="")
        for r in fit.rows:
            what = " ".join(f"{k}={r[k]}" for k in ("batch", "ctx", "tokens") if k in r)
            log(f"{r['kind']:8s} {what:22s} measured {r['measured_s'] * 1e6:10.1f} us  "
                f"fitted {r['predicted_s'] * 1e6:10.1f} us  {r['rel_error']:+.1%}")
    return 0
