"""The live decision path replayed on a fixed script (evaluation.replay_live_decisions): the elastic run's
controller joins the hybrid while training is the bottleneck and releases it once rollout is."""

from evaluation.replay_live_decisions import replay


def test_live_elastic_replay_joins_then_releases():
    events = replay("live_elastic")
    kinds = [(e["step"], e["event"]) for e in events]
    assert kinds[0] == (1, "initial_plan")
    join = next(s for s, k in kinds if k == "join")
    release = next(s for s, k in kinds if k == "release")
    assert join < release  # the trainer is slow early (join), rollout grows 40x and needs the GPU back
    assert "7 GPUs" in events[0]["detail"]  # 8 emulated H100s, one of them the hybrid
