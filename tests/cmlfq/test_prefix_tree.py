"""Causal prefix tree: statistics against a brute-force recomputation, persistence, bad files, eviction."""

import json
import random
import subprocess
import sys

import pytest

from areal_libra.cmlfq import PrefixTree, ToolState, TreeFileError, cpp_available, decision_contexts, tool_state
from areal_libra.cmlfq.policy import CMLFQPolicy
from areal_libra.trace import Segment, ToolReturn, Trajectory

BACKENDS = ["python"] + (["cpp"] if cpp_available() else [])


def random_trajs(n: int, seed: int, prompts: int = 5) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segs = []
        for _ in range(rng.randint(0, 4)):
            tool = ToolReturn(rng.choice(["search", "python"]), rng.choice([10, 400, 800, 6000]),
                              rng.choice(["success", "success", "failure", "timeout"]))
            segs.append(Segment(rng.randint(0, 300), tool))
        segs.append(Segment(rng.randint(1, 500), None))
        out.append(Trajectory(f"t{i}", f"p{rng.randrange(prompts)}", 0, rng.randint(10, 900), tuple(segs)))
    return out


class Brute:
    """Recompute every node's statistics from the raw list of inserted trajectories."""

    def __init__(self, trajs, min_samples, window):
        self.rows = []
        for t in trajs:
            states = tuple(tool_state(r) for r in t.tool_returns())
            rem = [t.final_length - c for c in decision_contexts(t)]
            self.rows.append((t.prompt_id, states, rem))
        self.min_samples, self.window = min_samples, window

    def samples(self, prompt, prefix):
        d = len(prefix)
        return [rem[d] for p, st, rem in self.rows
                if (prompt is None or p == prompt) and len(st) >= d and st[:d] == prefix]

    def deepest(self, prompt, states):
        best = None
        for d in range(len(states) + 1):
            s = self.samples(prompt, tuple(states[:d]))
            if not s:
                break
            if len(s) >= self.min_samples:
                best = d
        return best

    def lookup(self, prompt, states, q, floors, prompt_first):
        g = self.deepest(None, states)
        p = self.deepest(prompt, states)
        if p is not None and (prompt_first or g is None or p >= g):
            owner, depth, from_global = prompt, p, False
        else:
            owner, depth, from_global = None, (g if g is not None else 0), True
        s = self.samples(owner, tuple(states[:depth]))
        win = s[-self.window:]
        floor = floors[depth] if floors and depth < len(floors) else 0
        sub = sorted(x for x in win if x >= floor)
        if not win:
            return (0.0, 0, 0, depth, from_global, 0)
        if not sub:
            return (float(floor), floor, len(s), depth, from_global, floor)
        m = len(sub)
        rank_q = max(1, -(-int(q * 1000) * m // 1000))  # ceil(q * m) for q with 3 decimals
        return (sum(sub) / m, sub[-(-9 * m // 10) - 1], len(s), depth, from_global, sub[rank_q - 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_equal_brute_force(backend):
    trajs = random_trajs(400, seed=1)
    tree = PrefixTree(min_samples=3, window=7, backend=backend)
    for t in trajs:
        tree.insert(t)
    brute = Brute(trajs, 3, 7)
    rng = random.Random(2)
    probes = random_trajs(150, seed=3, prompts=7)  # prompts p5, p6 were never inserted
    checked = 0
    for t in probes:
        states = [tool_state(r) for r in t.tool_returns()]
        for k in range(len(states) + 1):
            floors = [rng.choice([0, 50, 300, 2000]) for _ in range(k + 1)]
            for q in (0.3, 0.5):
                for pf in (False, True):
                    got = tree.lookup(t.prompt_id, states[:k], q=q, floors=floors, prompt_first=pf)
                    want = brute.lookup(t.prompt_id, states[:k], q, floors, pf)
                    assert (got.mean, got.p90, got.count, got.depth, got.from_global, got.pq) == pytest.approx(want)
                    checked += 1
            plain = tree.lookup(t.prompt_id, states[:k])
            assert (plain.mean, plain.p90, plain.count) == pytest.approx(brute.lookup(t.prompt_id, states[:k], 0.5,
                                                                                        None, False)[:3])
    assert checked > 500


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_prompt_falls_back_to_global_and_empty_tree_is_zero(backend):
    tree = PrefixTree(min_samples=2, backend=backend)
    st = tree.lookup("nobody", [ToolState("search", "small", "success")])
    assert (st.count, st.depth, st.from_global, st.mean) == (0, 0, True, 0.0)
    for t in random_trajs(30, seed=4, prompts=1):
        tree.insert(t)
    st = tree.lookup("unseen", [])
    assert st.from_global and st.count == 30


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_round_trip_and_continue(tmp_path, backend):
    trajs = random_trajs(300, seed=5)
    tree = PrefixTree(min_samples=2, window=9, max_nodes=10_000, backend=backend)
    for t in trajs[:200]:
        tree.insert(t)
    path = tmp_path / "tree.json"
    tree.save(path)
    assert json.loads(path.read_bytes().split(b"\n", 1)[0])["version"] == 1
    for other in BACKENDS:
        back = PrefixTree.load(path, backend=other)
        assert back.backend == other and back.dump() == tree.dump()
        for t in trajs[200:]:
            back.insert(t)
        ref = PrefixTree(min_samples=2, window=9, max_nodes=10_000, backend=backend)
        for t in trajs:
            ref.insert(t)
        assert back.dump() == ref.dump()


def _saved(tmp_path):
    tree = PrefixTree(min_samples=2)
    for t in random_trajs(50, seed=6):
        tree.insert(t)
    path = tmp_path / "tree.json"
    tree.save(path)
    return path


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[: len(b) - 40], "truncated"),
    (lambda b: b[:-30] + bytes([b[-30] ^ 0x01]) + b[-29:], "corrupted"),
    (lambda b: b"garbage\n" + b, "not a prefix-tree file"),
    (lambda b: b[:0], "not a prefix-tree file"),
    (lambda b: b.replace(b'"version": 1', b'"version": 99', 1), "version 99"),
])
def test_damaged_file_gives_clear_error(tmp_path, damage, message):
    path = _saved(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TreeFileError, match=message) as e:
        PrefixTree.load(path)
    assert str(path) in str(e.value)


def test_live_path_falls_back_to_empty_tree_with_warning(tmp_path):
    path = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    # The warning is checked in a fresh interpreter: other tests import AReaL, whose getLogger re-runs
    # logging.config.dictConfig and reshapes logging for the whole test process.
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "from areal_libra.cmlfq.policy import CMLFQPolicy\n"
        f"CMLFQPolicy([100, 1000], tree_path={str(path)!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    policy = CMLFQPolicy([100, 1000], tree_path=str(path))
    assert "empty tree" in text and "truncated" in text
    assert policy.tree.node_count() == 1
    from areal_libra.cmlfq import RequestInfo
    req = RequestInfo("t", "p", 10, 50, 40, (ToolReturn("search", 10),), decision_contexts=(10, 50))
    assert policy.start(req) == 0 and policy.tool_return(req, 0) == 0
    missing = CMLFQPolicy([100, 1000], tree_path=str(tmp_path / "none.json"))
    assert missing.tree.node_count() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_node_cap_evicts_least_recently_used(backend):
    tree = PrefixTree(min_samples=1, max_nodes=60, backend=backend)
    trajs = random_trajs(400, seed=7, prompts=80)
    keep = trajs[0]
    for i, t in enumerate(trajs):
        tree.insert(t)
        if i % 5 == 0:  # keep one prompt in use
            tree.lookup(keep.prompt_id, [])
        assert tree.node_count() <= 60
    assert not tree.lookup(keep.prompt_id, []).from_global
    # Prompts inserted early and never used again are gone: lookups fall back to the global root.
    stale = {t.prompt_id for t in trajs[:20]} - {t.prompt_id for t in trajs[300:]} - {keep.prompt_id}
    assert stale
    for pid in stale:
        assert tree.lookup(pid, []).from_global


@pytest.mark.parametrize("backend", BACKENDS)
def test_rebuild_equals_fresh_tree(backend):
    trajs = random_trajs(120, seed=8)
    a = PrefixTree(min_samples=2, backend=backend)
    for t in trajs:
        a.insert(t)
    a.rebuild(trajs[60:])
    b = PrefixTree(min_samples=2, backend=backend)
    for t in trajs[60:]:
        b.insert(t)
    assert a.dump() == b.dump()
