"""The simulated trainer runs the micro-batch size the plan configured (Libra sets Megatron's
micro_batch_size); without one it keeps its own default of at most 4·PP micro-batches."""

from areal_libra.sim.cluster import TrainLayout
from areal_libra.sim.hardware import truth_for


def test_micro_batches_follow_the_configured_size():
    assert TrainLayout(1, 4, 4).micro_batches(128) is None  # trainer default
    assert TrainLayout(1, 4, 4, micro_batch=1).micro_batches(128) == 32
    assert TrainLayout(1, 4, 4, micro_batch=2).micro_batches(128) == 16
    assert TrainLayout(1, 4, 64, micro_batch=4).micro_batches(128) == 1  # never below one


def test_smaller_micro_batches_shrink_the_pipeline_bubble_in_the_truth():
    truth = truth_for("a800", "qwen3-14b")
    lens = [4000] * 128
    default = truth.train_step_s(lens, 1, 4, 4)  # 16 micro-batches: bubble 3/19
    planned = truth.train_step_s(lens, 1, 4, 4, TrainLayout(1, 4, 4, 1).micro_batches(len(lens)))  # 32: 3/35
    assert planned < default
    # PP 1 has no bubble: the micro-batch count changes nothing.
    assert truth.train_step_s(lens, 2, 1, 8, 16) == truth.train_step_s(lens, 2, 1, 8, 2)


def test_libra_layout_carries_the_plans_micro_batch():
    from areal_libra.planner import PlannerConfig, solve
    from areal_libra.sim.libra import layout_from_plan

    plan = solve("a800x48", "qwen3-14b", [(500, 3000), (800, 9000)] * 32, PlannerConfig(global_batch=128))
    lay = layout_from_plan(plan, 40960)
    assert lay.train.micro_batch == plan.train.micro_batch >= 1
    assert (lay.train.tp, lay.train.pp, lay.train.dp) == (plan.train.tp, plan.train.pp, plan.train.dp)
