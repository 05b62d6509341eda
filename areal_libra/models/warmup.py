"""Supervised warm-up on deliberately imperfect tool-use demonstrations, and a sampled-success probe.

Without a warm-up a random policy never produces a correct 'Answer:' and GRPO gets no signal; with clean
demonstrations it succeeds too often to leave room to learn. So half of the demonstrations skip the tool
(the tiny model cannot do the arithmetic itself) and a share of the tool demonstrations copy the tool's
result wrongly into the answer; RL then has to learn to call the tool and copy faithfully."""

from __future__ import annotations

import importlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from areal_libra.workflows.markup import CALC_CLOSE, CALC_OPEN, TOOL_TOKENS, extract_call, format_result
from areal_libra.workflows.math_data import MathProblem, dapo_prompt, generate_problems, problem_messages
from areal_libra.workflows.reward import dapo_math_reward


@dataclass(frozen=True)
class WarmupConfig:
    """Defaults: the code and search_r1 tasks' recipe (and the math one before MATH_WARMUP)."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    # Measured (lead): with half the demonstrations answering without the tool, copying the tool result
    # was not learned in 300 steps (sampled success 0); with 3 in 4 calling it, success was 0.55 at step
    # 200 (tool use 0.79, 0.70 with the tool): room for RL to raise tool use and copy accuracy.
    tool_fraction: float = 0.75  # demonstrations that call the tool
    corrupt_fraction: float = 0.2  # tool demonstrations whose answer miscopies the tool result
    seed: int = 0
    clean_share: float = 0.0  # the first steps (this share) on clean demonstrations: tool always, no miscopy


# The dapo_math policy's recipe (a third of the demonstrations of the 300 x 64 one). Measured (tinymodel, 2
# shared cores): the copies (question -> call, result -> answer) appear as a sudden drop of the loss; a lower
# lr brings it earlier (1.5e-3: by step ~100 at batch 32; 3e-3: ~step 100 at batch 64; 5e-3 and 6e-3: not
# within 100-200 steps), and clean demonstrations first bring both copies in one go. The imperfect mix of
# the last 30% sets the tool use and the miscopies that RL then improves on. Built: 38.5 s CPU (the 300 x 64
# recipe: 122 s); sampled success 0.29, tool use 0.65; the default 100-step run: reward 0.422 -> 0.685.
MATH_WARMUP = WarmupConfig(steps=200, batch_size=32, lr=1.5e-3, clean_share=0.7)


def corrupt_number(s: str, rng: random.Random) -> str:
    """A plausible miscopy of a number: one digit replaced, dropped, duplicated or two swapped."""
    digits = list(s)
    i = rng.randrange(len(digits))
    kind = rng.randrange(4) if len(digits) > 1 else rng.choice((0, 2))
    if kind == 0:
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    elif kind == 1:
        del digits[i]
    elif kind == 2:
        digits.insert(i, digits[i])
    else:
        j = i + 1 if i + 1 < len(digits) else i - 1
        if digits[i] == digits[j]:
            digits[i] = str((int(digits[i]) + 1) % 10)
        else:
            digits[i], digits[j] = digits[j], digits[i]
    out = "".join(digits).lstrip("0") or "0"
    return out if out != s else str(int(s) + 1)


def demonstration(p: MathProblem, rng: random.Random, cfg: WarmupConfig) -> list[tuple[str, bool]]:
    """The completion of one demonstration as (text, trained) segments; tool results are not trained
    on, as in RL, where they are loss-masked."""
    ans = str(p.answer)
    if rng.random() >= cfg.tool_fraction:
        return [(f"Answer: {ans}", True)]
    said = corrupt_number(ans, rng) if rng.random() < cfg.corrupt_fraction else ans
    return [(f"{CALC_OPEN}{p.expression}{CALC_CLOSE}", True), (format_result(ans), False), (f"\nAnswer: {said}", True)]


def _math_messages(p: MathProblem) -> list[dict[str, str]]:
    return problem_messages(dapo_prompt(p.question))


def _math_tool(p: MathProblem, expr: str) -> str:
    from areal_libra.workflows.tools import calculator_payload

    return format_result(calculator_payload(expr))


def _math_reward(p: MathProblem, completion: str) -> float:
    return dapo_math_reward("", completion, [], [], str(p.answer))


def _math_corpus(n: int) -> list[str]:
    """Whole episodes as the model sees them: the chat-rendered prompt, then a tool-using completion."""
    problems = generate_problems(n, seed=20_000, id_prefix="tok")
    return ["".join(m["content"] + "\n" for m in _math_messages(p))  # = the tokenizer's chat template
            + f"{CALC_OPEN}{p.expression}{CALC_CLOSE}{format_result(str(p.answer))}\nAnswer: {p.answer}"
            for p in problems]


@dataclass(frozen=True)
class WarmupTask:
    """What the warm-up, the probe and the tokenizer need to know about a task (math: the default)."""

    name: str
    problems: Callable[[int, int, str], list]  # (n, seed, id_prefix) -> problems
    messages: Callable[[Any], list[dict[str, str]]]  # the workflow's prompt messages
    demonstration: Callable[[Any, random.Random, WarmupConfig], list[tuple[str, bool]]]
    close_tag: str  # generation stops at it; the tool is called
    extract: Callable[[str], str | None]  # the call that a turn's text ends with
    tool: Callable[[Any, str], str]  # (problem, call) -> the text appended to the context
    reward: Callable[[Any, str], float]  # (problem, completion) -> the training reward
    tokenizer_corpus: Callable[[int], list[str]]
    tool_tokens: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)  # demonstration settings (part of the model digest)


MATH_TASK = WarmupTask("math", lambda n, seed, prefix: generate_problems(n, seed=seed, id_prefix=prefix),
                       _math_messages, lambda p, rng, cfg: demonstration(p, rng, cfg), CALC_CLOSE, extract_call,
                       _math_tool, _math_reward, _math_corpus, TOOL_TOKENS)
_TASKS = {"math": "areal_libra.models.warmup:MATH_TASK", "code": "areal_libra.models.code_task:CODE_TASK"}
_TASKS["search_r1"] = "areal_libra.models.search_task:SEARCH_TASK"


def get_task(name: str) -> WarmupTask:
    if name not in _TASKS:
        raise ValueError(f"unknown warm-up task {name!r} (known: {', '.join(_TASKS)})")
    mod, _, attr = _TASKS[name].partition(":")
    return getattr(importlib.import_module(mod), attr)


def prompt_ids(tokenizer, p: MathProblem) -> list[int]:
    return prompt_ids_batch(tokenizer, [p])[0]


def prompt_ids_batch(tokenizer, problems: list, task: WarmupTask = MATH_TASK) -> list[list[int]]:
    """Prompt token ids exactly as the workflow makes them (chat template, then encode)."""
    texts = tokenizer.apply_chat_template([task.messages(p) for p in problems],
                                          tokenize=False, add_generation_prompt=True)
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def _batch(tokenizer, problems: list, rng: random.Random, cfg: WarmupConfig, task: WarmupTask = MATH_TASK):
    import torch

    demos = [task.demonstration(p, rng, cfg) for p in problems]
    flat = [text for d in demos for text, _ in d]
    encoded = iter(tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    seqs, masks = [], []
    for ids, demo in zip(prompt_ids_batch(tokenizer, problems, task), demos):
        ids = list(ids)
        mask = [0] * len(ids)
        for _text, trained in demo:
            seg = next(encoded)
            ids += seg
            mask += [int(trained)] * len(seg)
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
        seqs.append(ids)
        masks.append(mask)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return input_ids, loss_mask, attn


def demo_config(cfg: WarmupConfig, step: int) -> WarmupConfig:
    """The demonstrations of a step: clean ones (the tool always, copied faithfully) for the first
    `clean_share` of the steps, where both copies (question -> call, result -> answer) are learned fastest,
    then the imperfect mix that leaves RL its room."""
    return replace(cfg, tool_fraction=1.0, corrupt_fraction=0.0) if step < cfg.clean_share * cfg.steps else cfg


def fit_threads(own: int = 0) -> int:
    """Torch threads for now: the cores the other processes leave idle (load average less `own`, our
    threads), at least 1, at most 4 (the tiny model's matrices gain nothing beyond). On an oversubscribed
    machine OpenMP threads spin against each other (measured: 2 threads cost 3-5x the CPU time of 1 for
    the same step), so the warm-up asks again every 25 steps."""
    cores = os.cpu_count() or 1
    return max(1, min(4, cores, round(cores - max(0.0, os.getloadavg()[0] - own))))


def supervised_warmup(model, tokenizer, cfg: WarmupConfig,
                      progress: Callable[[int, float], None] | None = None,
                      task: WarmupTask = MATH_TASK) -> list[float]:
    """Train `model` in place on fresh demonstrations every step; returns the loss per step."""
    import torch

    torch.manual_seed(cfg.seed)
    rng = random.Random(f"warmup-{cfg.seed}")
    problems = task.problems(cfg.steps * cfg.batch_size, 10_000 + cfg.seed, "warmup")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / cfg.steps))
    model.train()
    losses = []
    for step in range(cfg.steps):
        if step % 25 == 0:
            torch.set_num_threads(fit_threads(own=torch.get_num_threads() if step else 0))
        ids, mask, attn = _batch(tokenizer, problems[step * cfg.batch_size : (step + 1) * cfg.batch_size], rng,
                                 demo_config(cfg, step), task)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                                reduction="none").view_as(mask[:, 1:])
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, losses[-1])
    model.eval()
    return losses


@dataclass
class ProbeResult:
    episodes: int
    success: float  # mean reward over all sampled episodes
    tool_use: float  # share of episodes that called the tool at least once
    success_with_tool: float  # mean reward of the episodes that called the tool
    success_without_tool: float  # mean reward of those that did not
    seconds: float


def sampled_success(model, tokenizer, problems: list, temperature: float = 1.0,
                    max_turns: int = 3, max_new_tokens: int = 32, seed: int = 0,
                    tool: Callable[[str], str] | None = None, task: WarmupTask = MATH_TASK) -> ProbeResult:
    """Run the agentic episode (generate, stop at the task's close tag, append the tool result, resume) for
    each problem with HF generate, sampling at `temperature`; score with the training reward. `tool`: a
    replacement for the math calculator's payload function."""
    import torch
    from transformers import GenerationConfig

    call_tool = task.tool if tool is None else (lambda p, expr: format_result(tool(expr)))
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(task.close_tag)]
    gen_cfg = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                               max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=tokenizer.pad_token_id)
    seqs = [list(x) for x in prompt_ids_batch(tokenizer, problems, task)]
    completions = ["" for _ in problems]
    used_tool = [False] * len(problems)
    active = list(range(len(problems)))
    for _turn in range(max_turns):
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(seqs[i])) + seqs[i] for i in active])
        attn = torch.tensor([[0] * (width - len(seqs[i])) + [1] * len(seqs[i]) for i in active])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg)
        still = []
        for row, i in enumerate(active):
            new = out[row, width:].tolist()
            if pad in new:  # finished rows are padded after their stop token
                new = new[: new.index(pad)]
            text = tokenizer.decode(new, skip_special_tokens=True)
            seqs[i] = seqs[i] + new
            completions[i] += text
            expr = task.extract(text)
            if expr is not None and new and new[-1] == stop_ids[1]:
                used_tool[i] = True
                result = call_tool(problems[i], expr)
                seqs[i] += tokenizer.encode(result, add_special_tokens=False)
                completions[i] += result
                still.append(i)
        active = still
    rewards = [task.reward(p, c) for c, p in zip(completions, problems)]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return ProbeResult(
        episodes=len(problems),
        success=mean(rewards),
        tool_use=mean([float(u) for u in used_tool]),
        success_with_tool=mean([r for r, u in zip(rewards, used_tool) if u]),
        success_without_tool=mean([r for r, u in zip(rewards, used_tool) if not u]),
        seconds=time.perf_counter() - t0,
    )
