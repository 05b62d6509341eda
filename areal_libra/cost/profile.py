"""python -m areal_libra.cost.profile [--device cpu|cuda] [--layer] [--table FILE.json] [--out FILE.yaml] [--json]

Two profiles, both fitted by areal_libra.cost.calibrate:

- layer (the GPU profile; `--device cuda`, or `--layer` on CPU): times ONE decoder layer of the target model
  (--model, a preset; --shape to override) at its real shape (cost.layer_bench: decode under CUDA graphs
  across batch sizes and contexts, prefill across lengths, forward + backward) and fits per-layer figures
  (cost.layer_fit: efficiencies + per-layer overheads; whole model = layers x layer + head + per-step
  terms). `--table FILE.json` fits a measured table instead of measuring (tests/data/h200_measured.json:
  the `h200-fitted` preset). A fit outside its tolerances (decode 15% at batch >= 16, prefill 25%) is
  refused: one line, exit 2, nothing written.
- whole model (`--device cpu`, the default): a small Hugging Face Qwen2 with torch on this machine
  (prefill, decode steps, training steps with AdamW): the `cpu` preset of the embedded CPU cluster, whose
  model is this small. On CPU one "device" is one thread.

Writes the calibrated HardwareSpec as YAML (atomically) to --out, or prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from areal_libra.cost.calibrate import Calibration
from areal_libra.cost.presets import ModelSpec, PresetError, load_hardware
from areal_libra.cost.training import TrainParallel
from areal_libra.models.shape import Qwen2Shape
from areal_libra.utils import atomic_write_text


def profile_shape(hidden: int = 256, layers: int = 4) -> Qwen2Shape:
    """The timed model: a head per 64 of width, a KV head per 128, a 4x MLP (default: 256 wide, 4 layers)."""
    return Qwen2Shape(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), intermediate_size=4 * hidden, vocab_size=2048,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def _median_time(fn, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def model_spec(shape: Qwen2Shape, dtype_bytes: int) -> ModelSpec:
    """The cost model's description of a small Qwen2 shape."""
    return ModelSpec(name=f"qwen2-h{shape.hidden_size}-l{shape.num_hidden_layers}",
                     n_layers=shape.num_hidden_layers, hidden=shape.hidden_size, n_heads=shape.num_attention_heads,
                     n_kv_heads=shape.num_key_value_heads, head_dim=shape.head_dim, ffn=shape.intermediate_size,
                     vocab=shape.vocab_size, tie_embeddings=shape.tie_word_embeddings, dtype_bytes=dtype_bytes)


def build_model(shape: Qwen2Shape, device: str):
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = Qwen2ForCausalLM(shape.hf_config()).to(device=device, dtype=dtype)
    return model, model_spec(shape, 4 if device == "cpu" else 2)


def measure(model, spec: ModelSpec, device: str, quick: bool, cal: Calibration, log) -> None:
    import torch

    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    rep = 2 if quick else 3
    model.eval()
    with torch.no_grad():
        for n in ((64, 256) if quick else (64, 256, 1024)):
            ids = torch.randint(0, spec.vocab, (1, n), device=device)
            model(ids)  # warm-up
            t = _median_time(lambda ids=ids: model(ids, use_cache=True), rep, sync)
            cal.add_prefill(1, n, t)
            log(f"prefill tokens={n}: {t * 1000:.2f} ms")
        for batch in ((1, 8) if quick else (1, 4, 16)):
            for kv in ((64,) if quick else (64, 256)):
                ids = torch.randint(0, spec.vocab, (batch, kv), device=device)
                out = model(ids, use_cache=True)
                cache = out.past_key_values
                nxt = torch.randint(0, spec.vocab, (batch, 1), device=device)
                steps = 4

                def run(cache=cache, nxt=nxt, steps=steps):
                    for _ in range(steps):
                        model(nxt, past_key_values=cache, use_cache=True)

                model(nxt, past_key_values=cache, use_cache=True)  # warm-up
                t = _median_time(run, 1 if quick else 2, sync) / steps
                cal.add_decode(1, batch, batch * (kv + 2 + steps), t)
                log(f"decode batch={batch} kv={kv}: {t * 1000:.2f} ms/step")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for bs, n in (((2, 128),) if quick else ((4, 128), (2, 512))):
        ids = torch.randint(0, spec.vocab, (bs, n), device=device)

        def step(ids=ids):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up (allocates optimizer state)
        t = _median_time(step, rep, sync)
        cal.add_train(TrainParallel(1, 1, 1, 1, bs), [n] * bs, t)
        log(f"train batch={bs}x{n}: {t * 1000:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_libra.cost.profile", description=__doc__.split("\n\n")[1])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--hardware", default=None, help="preset to start from (default: cpu, or h100 on cuda)")
    ap.add_argument("--out", default=None, help="write the calibrated hardware YAML here")
    ap.add_argument("--json", action="store_true", help="print the fit report as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller measurements (a few seconds)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (one device = one thread)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer", action="store_true", help="the layer profile on CPU (the default on cuda)")
    ap.add_argument("--model", default="qwen3-14b", help="layer profile: the target model preset")
    ap.add_argument("--shape", default=None, help="layer profile: HIDDEN,HEADS,KV_HEADS,HEAD_DIM,FFN instead of --model's")
    ap.add_argument("--table", default=None, help="layer profile: fit this measured table (JSON) instead of measuring")
    ap.add_argument("--save-table", default=None, help="layer profile: also write the measured table (JSON) here")
    ap.add_argument("--name", default=None, help="layer profile: the preset's name (default: <hardware>-fitted)")
    args = ap.parse_args(argv)
    if args.table or args.layer or args.device == "cuda":
        from areal_libra.cost.profile_layer import main_layer

        return main_layer(args)
    try:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device is available", file=sys.stderr)
            return 2
        hw0 = load_hardware(args.hardware or ("cpu" if args.device == "cpu" else "h100"))
    except PresetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    try:
        shape = profile_shape(args.hidden, args.layers)
    except ValueError as e:
        print(f"error: --hidden/--layers: {e}", file=sys.stderr)
        return 2
    model, spec = build_model(shape, args.device)
    cal = Calibration(hw0, spec)
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    t0 = time.perf_counter()
    measure(model, spec, args.device, args.quick, cal, log)
    # The profiled train step is forward + backward + optimizer: no recompute, no extra log-prob pass.
    train_kw = {"recompute": False, "logprob_passes": 0}
    res = cal.fit(train_kw)
    hw = res.hardware
    fields = {k: (v if isinstance(v, (int, str)) else float(v)) for k, v in asdict(hw).items() if k != "name"}
    header = (f"# Calibrated by: python -m areal_libra.cost.profile --device {args.device}"
              f"{' --quick' if args.quick else ''} ({spec.name}, {args.threads} thread(s))\n"
              f"# mean relative error after fit: "
              + ", ".join(f"{k} {v:.1%}" for k, v in res.rel_error.items()) + "\n")
    text = header + "".join(f"{k}: {v!r}\n" for k, v in fields.items())
    if args.out:
        atomic_write_text(args.out, text)
    report = {"hardware": fields, "alpha": res.alpha, "beta": res.beta, "rel_error": res.rel_error,
              "model": spec.name, "samples": len(cal.samples), "wall_s": round(time.perf_counter() - t0, 2)}
    if args.json:
        print(json.dumps(report))
    else:
        if not args.out:
            print(text, end="")
        print(f"fit: alpha={res.alpha} beta={res.beta} rel_error={res.rel_error} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
