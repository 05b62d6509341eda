"""Child process of test_consumption_rule.py: AReaL's BatchTaskDispatcher (the patched copy first on the
path) with its real AsyncTaskRunner and StalenessManager. Prints one JSON line: for the consumption rule
installed ("rule") and AReaL's own rule ("areal"), the task names of the batches for versions 0 and 1 and
the wait for the second; and the priority in SGLang's payload with and without the router's ("payload").
One process: importing AReaL takes about a minute on a loaded machine."""

import asyncio
import json
import logging
import sys
import time

from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import BatchTaskDispatcher

from areal_libra.live.lag_bound import consume_rule


class Version:
    def __init__(self) -> None:
        self.v = 0

    def get_version(self) -> int:
        return self.v


class Task:
    def __init__(self, task_id: int, name: str, secs: float) -> None:
        self.task_id, self.name, self.secs = task_id, name, secs


def run(mode: str) -> dict:
    eta, batch = 1, 2
    ver = Version()
    sm = StalenessManager(ver, max_concurrent_rollouts=64, consumer_batch_size=batch, max_staleness=eta)

    def factory(task: Task):
        async def run() -> str:
            await asyncio.sleep(task.secs)
            sm.on_rollout_accepted()
            return task.name

        return run

    d = BatchTaskDispatcher(max_queue_size=64, task_factory=factory, staleness_manager=sm)
    if mode == "rule":
        d.consume_rule = consume_rule(eta)
    d.initialize(logging.getLogger("child"))
    try:
        # version 0: AReaL's admission lets (0 + eta + 1) * batch = 4 groups start; "slow" is a straggler
        for i, (name, secs) in enumerate([("slow", 2.0), ("b", 0.05), ("c", 0.1), ("d", 0.15)]):
            d.submit_task_input(Task(i, name, secs))
        first = sorted(r for r in d.wait_results(batch, timeout=10))
        ver.v = 1  # the trainer's step 0 turned version 0 into 1: two more groups may start
        for i, (name, secs) in enumerate([("e", 0.05), ("f", 0.05)], start=4):
            d.submit_task_input(Task(i, name, secs))
        t0 = time.perf_counter()
        second = sorted(r for r in d.wait_results(batch, timeout=10))
        return {"first": first, "second": second, "wait_s": time.perf_counter() - t0}
    finally:
        d.destroy()


def gated() -> dict:
    """Patch 17: with the admission gate closed no task starts although the staleness bound allows four; once
    it opens they all run."""
    ver = Version()
    sm = StalenessManager(ver, max_concurrent_rollouts=64, consumer_batch_size=2, max_staleness=1)
    started: list[str] = []

    def factory(task: Task):
        async def run() -> str:
            started.append(task.name)
            sm.on_rollout_accepted()
            return task.name

        return run

    is_open = [False]
    d = BatchTaskDispatcher(max_queue_size=64, task_factory=factory, staleness_manager=sm)
    d.admit_gate = lambda: is_open[0]
    d.initialize(logging.getLogger("child"))
    try:
        for i, name in enumerate("abcd"):
            d.submit_task_input(Task(i, name, 0.0))
        time.sleep(0.5)
        while_closed = list(started)
        is_open[0] = True
        t0 = time.perf_counter()
        got = sorted(d.wait_results(4, timeout=10))
        return {"while_closed": while_closed, "after_open": got, "open_s": time.perf_counter() - t0}
    finally:
        d.destroy()


def payload_priority() -> list:
    from areal.api.io_struct import ModelRequest
    from areal.engine.sglang_remote import SGLangBackend

    b = SGLangBackend()
    with_prio = b.build_generation_request(ModelRequest(input_ids=[1, 2], metadata={"priority": 3}), False, 0)
    without = b.build_generation_request(ModelRequest(input_ids=[1, 2]), False, 0)
    return [with_prio.payload.get("priority"), "priority" in without.payload]


def main() -> int:
    print(json.dumps({"rule": run("rule"), "areal": run("areal"), "payload": payload_priority(), "gate": gated()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
