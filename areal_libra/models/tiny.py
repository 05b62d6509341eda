"""The embedded default's policy: a small Qwen2-architecture model and a local BPE tokenizer, warmed up by a
short supervised stage, built offline and cached.

    python -m areal_libra.models.tiny [--out DIR] [--force] [--seed N] [--task NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_libra.models.shape import TINY_QWEN2, Qwen2Shape
from areal_libra.models.tokenizer import build_tokenizer
from areal_libra.models.warmup import (
    MATH_TASK,
    MATH_WARMUP,
    WarmupConfig,
    fit_threads,
    get_task,
    sampled_success,
    supervised_warmup,
)
from areal_libra.utils import cache_root, pid_alive

BUILD_INFO = "build_info.json"  # written last: its presence marks a complete build
# Part of the cache directory's name (tiny-qwen2-math-v3-<digest>): bump it when the build recipe changes in a
# way the config does not capture, so a stale cached model is never reused. v3: the 2-3 minute math recipe.
FORMAT_VERSION = 3


@dataclass(frozen=True)
class TinyModelConfig:
    name: str = "tiny-qwen2-math"
    # vocab_size is the BPE vocabulary target; the model's table is the tokenizer's size rounded up to 64
    shape: Qwen2Shape = TINY_QWEN2
    tokenizer_corpus_problems: int = 2000
    warmup: WarmupConfig = MATH_WARMUP  # code and search_r1: WarmupConfig() (for_task)
    probe_episodes: int = 128  # sampled-success probe after the warm-up (0: skip)
    task: str = "math"  # the warm-up task (areal_libra.models.warmup.get_task): math | code

    @classmethod
    def for_task(cls, task: str) -> TinyModelConfig:
        """The default build for a warm-up task (math: the dapo_math policy; code: code_sandbox's)."""

        get_task(task)  # an unknown task is a ValueError here
        return cls() if task == "math" else cls(name=f"tiny-qwen2-{task}", task=task, warmup=WarmupConfig(),
                                                 probe_episodes=256)

    def digest(self, seed: int) -> str:
        """The cache key of a build: every field (shape, recipe, task settings) and the seed."""

        cfg = asdict(self) | {"task_params": get_task(self.task).params}
        blob = json.dumps({"cfg": cfg, "seed": seed, "v": FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_dir(cache_dir: str | Path | None = None, seed: int = 0, config: TinyModelConfig | None = None) -> Path:
    cfg = config or TinyModelConfig()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "models" / f"{cfg.name}-v{FORMAT_VERSION}-{cfg.digest(seed)}"


def is_complete(path: Path) -> bool:
    return (path / BUILD_INFO).is_file() and (path / "config.json").is_file()


def _tokenizer_corpus(n: int, task: str = "math") -> list[str]:
    """Whole episodes as the model sees them: the chat-rendered prompt, then a tool-using completion."""

    return get_task(task).tokenizer_corpus(n)


def build_model(out_dir: Path, config: TinyModelConfig, seed: int = 0, quiet: bool = False) -> dict:
    """Build tokenizer + model, warm it up, probe it, and save everything into out_dir (fp32 safetensors)."""
    import torch


    t0 = time.perf_counter()
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(fit_threads())  # the warm-up adjusts it as the machine's load changes
    try:
        return _build(out_dir, config, seed, quiet, t0)
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: Path, config: TinyModelConfig, seed: int, quiet: bool, t0: float) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM


    task = get_task(config.task)
    tokenizer = build_tokenizer(_tokenizer_corpus(config.tokenizer_corpus_problems, config.task),
                                config.shape.vocab_size, tool_tokens=task.tool_tokens)
    vocab = -(-len(tokenizer) // 64) * 64
    mcfg = config.shape.hf_config(
        vocab_size=vocab,
        rope_theta=10000.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        dtype="float32",
    )
    mcfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(mcfg).float()
    n_params = sum(p.numel() for p in model.parameters())
    wcfg = config.warmup if config.warmup.seed == seed else WarmupConfig(**{**asdict(config.warmup), "seed": seed})
    t_warm = time.perf_counter()
    losses = _warmup_with_progress(model, tokenizer, wcfg, quiet, task)
    warm_s = time.perf_counter() - t_warm
    probe = None
    if config.probe_episodes > 0:
        probe = sampled_success(model, tokenizer, task.problems(config.probe_episodes, 30_000 + seed, "probe"),
                                temperature=1.0, seed=seed, task=task, max_new_tokens=task.params.get("probe_new_tokens", 32))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    info = {
        "name": config.name,
        "seed": seed,
        "config": asdict(config),
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "warmup_seconds": round(warm_s, 2),
        "warmup_final_loss": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
        "probe": None if probe is None else asdict(probe),
        "build_seconds": round(time.perf_counter() - t0, 2),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _warmup_with_progress(model, tokenizer, cfg: WarmupConfig, quiet: bool, task=None) -> list[float]:

    task = task or MATH_TASK
    if quiet:
        return supervised_warmup(model, tokenizer, cfg, task=task)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file gets a line every 10% instead of a live bar
        t0 = time.perf_counter()
        every = max(1, cfg.steps // 10)

        def report(step: int, loss: float) -> None:
            if step % every == 0 or step == cfg.steps:
                print(f"areal_libra: warm-up {step}/{cfg.steps} loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)

        return supervised_warmup(model, tokenizer, cfg, progress=report, task=task)
    columns = (TextColumn("[bold]warm-up[/bold] {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as prog:
        bar = prog.add_task("warmup", total=cfg.steps, loss=float("nan"))
        return supervised_warmup(model, tokenizer, cfg, task=task,
                                 progress=lambda step, loss: prog.update(bar, completed=step, loss=loss))


def _remove_orphans(target: Path) -> None:
    """Temporary build dirs of builders that were killed (their pid is in the name) are removed."""

    for p in target.parent.glob(f".{target.name}.*"):
        parts = p.name[len(target.name) + 2 :].split(".")
        if parts and parts[0].isdigit() and not pid_alive(int(parts[0])):
            shutil.rmtree(p, ignore_errors=True)
        elif parts and not parts[0].isdigit() and time.time() - p.stat().st_mtime > 3600:
            shutil.rmtree(p, ignore_errors=True)  # an older builder's dir without a pid: stale after an hour


def ensure_model(cache_dir: str | Path | None = None, seed: int = 0, config: TinyModelConfig | None = None,
                 out: str | Path | None = None, force: bool = False, quiet: bool = False) -> Path:
    """The path of a complete model directory, building it first when missing (or when force).

    Builds in a temporary sibling directory and renames it into place, so a crash never leaves a
    half-written model that a later call would trust; a concurrent builder that wins the rename wins."""
    config = config or TinyModelConfig()
    target = Path(out) if out is not None else model_dir(cache_dir, seed, config)
    if is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", dir=target.parent))
    try:
        if not quiet:
            print(f"areal_libra: building {config.name} (seed {seed}) into {target}", file=sys.stderr)
        info = build_model(tmp, config, seed, quiet=quiet)
        if force and target.exists():
            shutil.rmtree(target)
        elif target.exists() and not is_complete(target):
            shutil.rmtree(target)  # debris of an older, interrupted non-atomic copy
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):
                raise
        if not quiet:
            probe = info["probe"] or {}
            print(f"areal_libra: built {target.name}: {info['parameters']:,} parameters in "
                  f"{info['build_seconds']:.1f} s; sampled success at T=1: {probe.get('success', float('nan')):.2f} "
                  f"(tool use {probe.get('tool_use', float('nan')):.2f})", file=sys.stderr)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_libra.models.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="exact output directory (default: the cache directory for this config)")
    ap.add_argument("--cache-dir", help="cache root (default: $AREAL_LIBRA_CACHE or ~/.cache/areal_libra)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even when a complete build exists")
    ap.add_argument("--task", default="math", help="the warm-up task (areal_libra.models.warmup.get_task)")
    args = ap.parse_args(argv)
    try:
        config = TinyModelConfig.for_task(args.task)
    except ValueError as e:
        print(f"error: --task: {e}", file=sys.stderr)
        return 2
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"error: --out {args.out} exists and is not a directory", file=sys.stderr)
        return 2
    try:
        path = ensure_model(cache_dir=args.cache_dir, seed=args.seed, config=config, out=args.out, force=args.force)
    except OSError as e:
        print(f"error: cannot build the model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
