"""SGLang native-API request validation and response shapes (the parts that do not need a model).

Kept apart from the HTTP server so the contract can be unit-tested on its own. Field names follow
SGLang 0.5.x's ``GenerateReqInput`` / ``SamplingParams``; anything not listed is rejected with a 400, and
fields SGLang has but this server cannot honour (images, LoRA, streaming, grammars, n > 1) are accepted only
at their neutral value so that AReaL's client (which sends ``image_data: null``) passes unchanged.
"""

from __future__ import annotations

import math
import reprlib
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sampling_seed: int | None = None


SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperatures below it mean greedy


class RequestError(ValueError):
    """A client error: reported as HTTP 400 {"error": {"message": ...}}."""


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 3, 60, 60, 8, 8


def short(v: Any) -> str:
    """A bounded repr of a client value for error messages (a 10 MB string or a 900-deep list must not be
    echoed back whole, nor recurse)."""
    return _repr.repr(v)


def names(keys: list[str], limit: int = 8) -> str:
    """Field names for an error message, at most ``limit`` of them, each shortened."""
    shown = ", ".join(k if len(k) <= 60 else short(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


# Top-level /generate fields: value must equal one of the given neutral values unless supported.
GENERATE_FIELDS_SUPPORTED = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "stream",
    "logprob_start_len",
    "priority",
}
GENERATE_FIELDS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "image_data": (None, []),
    "video_data": (None, []),
    "audio_data": (None, []),
    "input_embeds": (None,),
    "lora_path": (None,),
    "lora_id": (None,),
    "return_routed_experts": (None, False),
    "return_hidden_states": (None, False),
    "return_text_in_logprobs": (None, False, True),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "log_metrics": (None, True, False),
    "modalities": (None, []),
    "session_params": (None,),
    "custom_logit_processor": (None,),
    "data_parallel_rank": (None, 0),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "background": (None, False),
    "extra_key": (None,),
}

SAMPLING_SUPPORTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "frequency_penalty",
    "presence_penalty",
    "n",
    "sampling_seed",
}
SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (None, 0),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True, False),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "stop_regex": (None,),
    "custom_params": (None,),
    "logit_bias": (None, {}),
}


@dataclass
class GenerateInput:
    rid: str
    input_ids: list[int] | None
    text: str | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int = -1
    # Scheduling priority, lower first (SGLang's --schedule-low-priority-values-first; Libra sends its
    # trajectory's start version, cmlfq.aging.priority); None: after every prioritised request, FIFO.
    priority: int | None = None


def _check_neutral(obj: dict[str, Any], supported: set[str], neutral: dict[str, tuple[Any, ...]], where: str) -> None:
    unknown = sorted(k for k in obj if k not in supported and k not in neutral)
    if unknown:
        raise RequestError(f"Unknown field(s) in {where}: {names(unknown)}")
    for k, allowed in neutral.items():
        if k in obj and obj[k] not in allowed:
            raise RequestError(f"{where} field {k}={short(obj[k])} is not supported by the embedded server")


def _num(d: dict[str, Any], key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise RequestError(f"sampling_params.{key} must be a number, got {short(v)}")
    # JSON allows NaN/Infinity and ints beyond float range; either would reach the sampler as NaN/inf.
    if isinstance(v, int) and abs(v) > 2**53:
        raise RequestError(f"sampling_params.{key}={short(v)} is out of range [{lo}, {hi}]")
    if not math.isfinite(v):
        raise RequestError(f"sampling_params.{key} must be a finite number, got {v}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"sampling_params.{key}={v} is out of range [{lo}, {hi}]")
    return float(v)


def _int(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise RequestError(f"sampling_params.{key} must be an integer, got {short(v)}")
    return v


def _bool(d: dict[str, Any], key: str, default: bool, where: str = "sampling_params") -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{where}.{key} must be a boolean, got {short(v)}")
    return v


def parse_sampling_params(sp: Any, default_max_new_tokens: int) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object")
    _check_neutral(sp, SAMPLING_SUPPORTED, SAMPLING_NEUTRAL, "sampling_params")
    if _int(sp, "n", 1) != 1:
        raise RequestError("sampling_params.n must be 1 (send one request per sample)")
    stop = sp.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a non-empty string or a list of non-empty strings")
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")
    max_new = _int(sp, "max_new_tokens", default_max_new_tokens)
    if max_new < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {max_new}")
    top_k = _int(sp, "top_k", -1)
    if top_k == 0 or top_k < -1:
        raise RequestError(f"sampling_params.top_k must be -1 (all) or >= 1, got {top_k}")
    top_p = _num(sp, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise RequestError("sampling_params.top_p must be in (0, 1]")
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("sampling_params.sampling_seed must be an integer")
    temperature = _num(sp, "temperature", 1.0, 0.0, None)
    if temperature < SAMPLING_EPS:
        temperature = 0.0  # greedy, as SGLang does (logits / 1e-40 would overflow to NaN in float32)
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_bool(sp, "ignore_eos", False),
        skip_special_tokens=_bool(sp, "skip_special_tokens", True),
        no_stop_trim=_bool(sp, "no_stop_trim", False),
        frequency_penalty=_num(sp, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_num(sp, "presence_penalty", 0.0, -2.0, 2.0),
        sampling_seed=seed,
    )


def parse_generate(body: Any, default_max_new_tokens: int = 128) -> GenerateInput:
    """Validate a /generate body; raises RequestError with a message naming the offending field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    _check_neutral(body, GENERATE_FIELDS_SUPPORTED, GENERATE_FIELDS_NEUTRAL, "/generate request")
    if _bool(body, "stream", False, "request"):
        raise RequestError("stream=true is not supported by the embedded server")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("exactly one of text or input_ids must be given")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (batched requests are not supported)")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers (batched requests are not supported)")
    if text is not None and (not isinstance(text, str) or not text):
        raise RequestError("text must be a non-empty string (batched requests are not supported)")
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates (JSON "\udcff") make the tokenizer raise
            raise RequestError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None
    start = body.get("logprob_start_len")
    if start is None:
        start = -1
    if isinstance(start, bool) or not isinstance(start, int) or start < -1:
        raise RequestError("logprob_start_len must be an integer >= -1")
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise RequestError(f"priority must be an integer, got {short(priority)}")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise RequestError("rid must be a string")
    return GenerateInput(
        rid=rid,
        input_ids=ids,
        text=text,
        params=parse_sampling_params(body.get("sampling_params"), default_max_new_tokens),
        return_logprob=_bool(body, "return_logprob", False, "request"),
        logprob_start_len=start if _bool(body, "return_logprob", False, "request") else -1,
        priority=priority,
    )


def finish_text(tokenizer: Any, output_ids: list[int], params: SamplingParams, reason: dict[str, Any]) -> str:
    """The response ``text`` as SGLang builds it: a matched stop token is left out of the decoded text and
    a matched stop string (and anything after it) is cut off, unless no_stop_trim. ``output_ids`` and the
    logprobs still contain every generated token, including the ones that spelled the stop."""
    ids = output_ids
    matched = reason.get("matched")
    if isinstance(matched, int) and not isinstance(matched, bool) and ids and not params.no_stop_trim:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        pos = text.find(matched)
        if pos != -1:
            text = text[:pos]
    return text
