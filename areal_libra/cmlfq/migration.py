"""C-MLFQ's migration rule priced by the Cost Evaluator (areal_libra.cost): move a request to another TP bucket
only when the decode time its predicted remaining length saves there exceeds the time its re-prefill costs.

Both sides are request-seconds of waiting, the quantity routing moves around: a GRPO group is ready for
training when its last trajectory finishes, and every request a server holds waits while it works.

- Decode saving: the remaining length times the request's time per token on a server of each bucket's TP
  (RolloutCost.decode_step_s). A server runs at most `conc` requests like this one side by side
  (max_running, and the KV pool at the request's average resident context while it decodes the rest,
  context + remaining / 2). With the bucket's measured load (requests per server, this one included) at or
  below that, one step runs the whole load; above it the request also waits its turn, load / conc steps per
  token. Without a load the fleet is taken as balanced and busy: every GPU holds as many requests as a server
  of the smallest TP runs per GPU. A final context beyond the bucket's KV pool cannot stay there (infinite
  time). One more decoding request adds only its own KV read to its peers' step (memory-bound decode), so
  the saving is the request's own.
- Re-prefill cost: a prefill stops the whole running batch of its server (continuous batching runs prefill
  and decode in turn), so it costs its time x that batch. Moving prefills the whole context on the target
  (RolloutCost.prefill_s(context)); staying prefills only the tool payload on top of the cached context on
  the current server. The price is the difference.

The remaining length is the prefix tree's centre prediction (the decision returns it). The Cost Evaluator is
the planner's (hardware and model presets, calibrated where the caller has calibrated them); it never reads
the simulator's hardware truth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from areal_libra.cost.presets import HardwareSpec, ModelSpec
from areal_libra.cost.rollout import RolloutCost


@dataclass(frozen=True)
class MigrationPrice:
    saving_s: float  # request-seconds of decode the remaining length saves on the target (negative: it loses)
    cost_s: float  # extra request-seconds the move's prefill costs (whole context there vs the payload here)

    @property
    def worth(self) -> bool:
        return self.saving_s > self.cost_s


class MigrationPricer:
    """Prices a move between buckets whose servers have the given TP degrees (one per bucket, ascending
    bucket order) on one hardware and model spec."""

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, tps: Sequence[int], max_running: int = 256) -> None:
        if not tps or any(int(t) < 1 for t in tps):
            raise ValueError(f"migration pricing needs a TP >= 1 per bucket, got {list(tps)}")
        self.tps = tuple(int(t) for t in tps)
        self._cost = {tp: RolloutCost(hardware, model, tp, max_running) for tp in set(self.tps)}
        self._cap = {tp: c.kv_capacity_tokens() for tp, c in self._cost.items()}
        self.hardware, self.model, self.max_running = hardware, model, max_running

    def with_tps(self, tps: Sequence[int]) -> MigrationPricer:
        """The same hardware and model for another set of buckets (a re-plan)."""
        return MigrationPricer(self.hardware, self.model, tps, self.max_running)

    def _tp(self, bucket: int) -> int:
        return self.tps[min(max(bucket, 0), len(self.tps) - 1)]

    def _conc(self, tp: int, kv: float) -> float:
        return max(1.0, min(float(self._cost[tp].max_running), self._cap[tp] / kv))

    def occupancy(self, bucket: int, kv: float, load: float | None) -> tuple[float, float]:
        """(running batch, requests held) of a server of `bucket` for requests of average resident context
        `kv`: `load` requests (this one included), or a balanced busy fleet's share when None."""
        tp = self._tp(bucket)
        conc = self._conc(tp, kv)
        if load is None:
            small = min(self.tps)
            n = tp * (self._conc(small, kv) if self._cap[small] > 0 else 1.0) / small
        else:
            n = max(1.0, float(load))
        return min(n, conc), n

    def token_s(self, bucket: int, context: float, remaining: float, load: float | None = None) -> float:
        """Seconds one more decoded token of the request takes on a server of `bucket` holding `load`
        requests, the request included (None: a balanced, busy fleet) (module docstring)."""
        tp = self._tp(bucket)
        if self._cap[tp] <= 0 or context + remaining > self._cap[tp]:
            return math.inf  # it does not fit there: it would be preempted over and over
        kv = max(1.0, context + remaining / 2.0)
        batch, n = self.occupancy(bucket, kv, load)
        return float(self._cost[tp].decode_step_s(batch, batch * kv)) * (n / batch)

    def price(self, context: int, payload: int, remaining: float, current: int, target: int,
              loads: Sequence[float] | None = None) -> MigrationPrice:
        """Saving and cost of moving a request with `context` tokens (the last tool's `payload` included)
        and `remaining` predicted tokens to decode from bucket `current` to `target`. loads[b]: requests per
        server of bucket b (running and queued, without this one); None: a balanced, busy fleet."""
        last = len(self.tps) - 1
        current, target = min(max(current, 0), last), min(max(target, 0), last)
        load = (lambda b: None) if loads is None else (lambda b: float(loads[b]) + 1.0)
        here = self.token_s(current, context, remaining, load(current))
        there = self.token_s(target, context, remaining, load(target))
        if math.isinf(here) and math.isinf(there):
            saving = 0.0
        elif math.isinf(here):
            saving = math.inf
        else:
            saving = remaining * (here - there)
        payload = min(max(0, payload), context)
        kv = max(1.0, context + remaining / 2.0)
        move = float(self._cost[self._tp(target)].prefill_s(context)) * self.occupancy(target, kv, load(target))[0]
        stay = 0.0
        if payload:
            stay = (float(self._cost[self._tp(current)].prefill_s(payload, context - payload))
                    * self.occupancy(current, kv, load(current))[0])
        return MigrationPrice(saving, max(0.0, move - stay))
