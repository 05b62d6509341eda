"""Time ONE decoder layer of the target model at its real shape (the GPU profile; cost.layer_fit fits it).

The layer is plain torch: RMSNorm, fused QKV (GQA), attention (SDPA), output projection, RMSNorm, SwiGLU
MLP; random weights. Two layers are stacked and every figure is divided by 2 (one layer's launch gaps
are then counted once per layer, as in a real model). Measured:

- decode: one new token per sequence over a static KV cache of `ctx` tokens per sequence, across batch
  sizes and contexts; on CUDA replayed as a CUDA graph (as SGLang serves decode) and timed with CUDA
  events. GQA decode attention folds the query heads of a KV head into the query length;
- prefill: one sequence of n tokens, causal attention;
- train: forward + backward of one sequence (no optimizer).

On CPU the same code runs eagerly in fp32 with perf_counter timing, at whatever (small) shape is asked:
that keeps the code path tested on machines without a GPU. The result is a table in the schema of
tests/data/h200_measured.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    @property
    def params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden

    @classmethod
    def of_model(cls, spec) -> LayerShape:
        """The layer of a ModelSpec (cost.presets); dense models only."""
        if spec.is_moe:
            raise ValueError(f"{spec.name}: the layer profile covers dense models only")
        return cls(spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.ffn)


def _layer_cls():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, s: LayerShape) -> None:
            super().__init__()
            self.s = s
            self.norm1 = nn.Parameter(torch.ones(s.hidden))
            self.norm2 = nn.Parameter(torch.ones(s.hidden))
            self.qkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
            self.o = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
            self.gate_up = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
            self.down = nn.Linear(s.ffn, s.hidden, bias=False)

        @staticmethod
        def _rms(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        def _mlp(self, x):
            g, u = self.gate_up(self._rms(x, self.norm2)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)

        def _split(self, x):
            s = self.s
            q, k, v = self.qkv(self._rms(x, self.norm1)).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
            return q, k, v

        def forward(self, x):
            """Prefill / training: x [1, T, hidden], causal attention over the sequence."""
            s = self.s
            b, t, _ = x.shape
            q, k, v = self._split(x)
            q = q.view(b, t, s.heads, s.head_dim).transpose(1, 2)
            k = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            rep = s.heads // s.kv_heads
            k = k.repeat_interleave(rep, dim=1)  # GQA: every query head sees its KV head
            v = v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
            return self._mlp(x)

        def decode(self, x, k_cache, v_cache):
            """One token per sequence: x [B, 1, hidden]; caches [B, kv_heads, ctx, head_dim]. The query heads
            of a KV head are folded into the query length (no KV copy per query head)."""
            s = self.s
            b = x.shape[0]
            rep = s.heads // s.kv_heads
            q, _, _ = self._split(x)  # the new K/V would be appended; the cache is static here
            q = q.view(b, s.kv_heads, rep, s.head_dim)
            a = F.scaled_dot_product_attention(q, k_cache, v_cache)
            x = x + self.o(a.reshape(b, 1, s.heads * s.head_dim))
            return self._mlp(x)

    return Layer


class _Timer:
    """Seconds per call of fn: CUDA events on cuda (after warm-up), perf_counter on cpu; median of repeats."""

    def __init__(self, device: str, repeat: int, iters: int) -> None:
        self.device, self.repeat, self.iters = device, repeat, iters

    def __call__(self, fn: Callable[[], object]) -> float:
        import torch

        for _ in range(2):
            fn()
        times = []
        for _ in range(self.repeat):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(self.iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000.0 / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    fn()
                times.append((time.perf_counter() - t0) / self.iters)
        times.sort()
        return times[len(times) // 2]


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured as a CUDA graph (static inputs); the returned callable replays it."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def measure_layer(shape: LayerShape, device: str = "cuda", decode: Sequence[tuple[int, int]] = (),
                  prefill: Sequence[int] = (), train: Sequence[int] = (), graphs: bool = True,
                  repeat: int = 5, iters: int = 10, log: Callable[[str], None] = lambda s: None) -> dict:
    """The layer table: {"layer", "decode_us": [{batch, ctx, graph|eager}], "prefill_ms", "train_ms"}."""
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer_cls = _layer_cls()
    layers = [layer_cls(shape).to(device=device, dtype=dtype) for _ in range(2)]  # two stacked, result / 2
    timer = _Timer(device, repeat, iters)
    use_graph = graphs and device == "cuda"
    out: dict = {"gpu": torch.cuda.get_device_name().lower() if device == "cuda" else "cpu",
                 "device": device, "dtype": str(dtype).removeprefix("torch."),
                 "layer": {"params": shape.params} | asdict(shape), "decode_us": [], "prefill_ms": [], "train_ms": []}
    key = "graph" if use_graph else "eager"
    with torch.no_grad():
        for batch, ctx in decode:
            x = torch.randn(batch, 1, shape.hidden, device=device, dtype=dtype)
            caches = [(torch.randn(batch, shape.kv_heads, ctx, shape.head_dim, device=device, dtype=dtype),
                       torch.randn(batch, shape.kv_heads, ctx, shape.head_dim, device=device, dtype=dtype))
                      for _ in layers]

            def step(x=x, caches=caches):
                h = x
                for lay, (k, v) in zip(layers, caches):
                    h = lay.decode(h, k, v)
                return h

            t = timer(_graphed(step) if use_graph else step) / 2
            out["decode_us"].append({"batch": batch, "ctx": ctx, key: round(t * 1e6, 2)})
            log(f"decode batch={batch} ctx={ctx}: {t * 1e6:.1f} us per layer ({key})")
            del caches
        for n in prefill:
            x = torch.randn(1, n, shape.hidden, device=device, dtype=dtype)

            def fwd(x=x):
                h = x
                for lay in layers:
                    h = lay(h)
                return h

            t = timer(fwd) / 2
            out["prefill_ms"].append({"tokens": n, "ms": round(t * 1e3, 4)})
            log(f"prefill tokens={n}: {t * 1e3:.3f} ms per layer")
    for n in train:
        x = torch.randn(1, n, shape.hidden, device=device, dtype=dtype, requires_grad=True)

        def fwd_bwd(x=x):
            h = x
            for lay in layers:
                h = lay(h)
            h.float().pow(2).mean().backward()
            for lay in layers:
                lay.zero_grad(set_to_none=True)

        t = timer(fwd_bwd) / 2
        out["train_ms"].append({"tokens": n, "ms": round(t * 1e3, 4)})
        log(f"train tokens={n}: {t * 1e3:.3f} ms per layer (forward + backward)")
    return out
