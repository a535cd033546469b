"""The experiment commands' pure parts: comparing runs from their events (leap.experiments.compare)."""

from __future__ import annotations

import math

from leap.experiments import compare


def eval_event(step, evaluations, seconds, accuracy):
    return {"kind": "eval", "step": step, "values": {"pass_at_1/turn_1": accuracy, compare.EVALUATIONS: evaluations,
                                                     compare.SECONDS: seconds}}


def train_event(step, evaluations, seconds, expanded):
    return {"kind": "train", "step": step, "values": {compare.EVALUATIONS: evaluations, compare.SECONDS: seconds,
                                                      "expanded_share": expanded}}


LEAP = [eval_event(0, 0, 0, 0.25), train_event(1, 100, 10, 0.5), eval_event(5, 100, 10, 0.5), train_event(2, 150, 20, 0.3),
        eval_event(10, 150, 20, 0.625)]
MULTI = [eval_event(0, 0, 0, 0.25), train_event(1, 200, 25, 1.0), eval_event(5, 200, 25, 0.375),
         eval_event(10, 400, 50, 0.5)]


def test_curves_are_the_eval_events_in_step_order():
    points = compare.curve(list(reversed(LEAP)), "pass_at_1/turn_1")
    assert [(p.step, p.evaluations, p.seconds, p.accuracy) for p in points] == [
        (0, 0, 0, 0.25), (5, 100, 10, 0.5), (10, 150, 20, 0.625)]
    assert compare.curve(LEAP, "pass_at_1/turn_9") == []


def test_the_cost_to_reach_a_target_is_the_first_evaluation_at_it():
    leap = compare.curve(LEAP, "pass_at_1/turn_1")
    assert compare.cost_to_reach(leap, 0.5).step == 5
    assert compare.cost_to_reach(leap, 0.7) is None
    assert compare.cost_to_reach(leap, 0.2).step == 5  # not step 0: reaching the start costs no training
    multi_reached = compare.cost_to_reach(compare.curve(MULTI, "pass_at_1/turn_1"), 0.5)
    assert compare.ratio(multi_reached.seconds, compare.cost_to_reach(leap, 0.5).seconds) == 5.0
    assert math.isnan(compare.ratio(None, 3.0)) and math.isnan(compare.ratio(3.0, 0.0))


def test_summaries_and_the_table():
    metrics = ["pass_at_1/turn_1"]
    leap = compare.summarize("leap", LEAP, metrics, metrics[0], 0.5)
    multi = compare.summarize("multiturn", MULTI, metrics, metrics[0], 0.5)
    assert leap.final == {"pass_at_1/turn_1": 0.625} and leap.evaluations == 150 and leap.seconds == 20
    assert leap.expanded_share == 0.4 and multi.expanded_share == 1.0
    assert multi.reached.evaluations == 400
    table = compare.markdown_table([leap, multi], metrics, "0.500").splitlines()
    assert table[0].startswith("| run | held-out pass@1, turn 1 | sandbox evals")
    assert table[2] == "| leap | 0.625 | 150 | 20 | 40% | 100 | 10 |"
    unreached = compare.summarize("single", LEAP, metrics, metrics[0], 0.9)
    assert "not reached" in compare.markdown_table([unreached], metrics, "0.900")


def test_metric_labels_say_which_tasks():
    assert compare.label("train_tasks/pass_at_1/turn_3") == "training tasks pass@1, turn 3"
    assert compare.label("pass_at_1/turn_1") == "held-out pass@1, turn 1"


def test_the_plot_is_written(tmp_path):
    path = compare.plot_curves({"leap": LEAP, "multiturn": MULTI}, ["pass_at_1/turn_1"], tmp_path / "c.png", title="t")
    assert path.is_file() and path.stat().st_size > 1000


def test_a_runs_evaluations_are_split_by_task_set():
    from leap.common.v1 import common_pb2
    from leap.experiments.runs import FinishedRun

    both = common_pb2.MetricEvent(kind="eval", step=0, values={"pass_at_1/turn_1": 0.0, "train_tasks/pass_at_1/turn_1": 0.25,
                                                               "time/eval_s": 3.0})
    coverage = common_pb2.MetricEvent(kind="eval", step=5, values={"rgrpo/coverage": 0.5})
    run = FinishedRun(run=None, events=[both, coverage, common_pb2.MetricEvent(kind="train", step=1)])
    assert run.evaluations("train_tasks/") == [{"pass_at_1/turn_1": 0.25}]
    assert run.evaluations() == [{"pass_at_1/turn_1": 0.0, "time/eval_s": 3.0}]


def summary(name, heldout, evaluations, seconds):
    return compare.Summary(name, {"pass_at_1/turn_2": heldout}, evaluations, seconds, 0.5, None)


def test_figures_over_seeds_are_mean_and_standard_error_and_claims_count_the_seeds_they_held_on():
    seeds = [{"leap": summary("leap", 0.50, 100, 10), "multiturn": summary("multiturn", 0.50, 200, 20),
              "single": summary("single", 0.25, 50, 5)},
             {"leap": summary("leap", 0.25, 120, 12), "multiturn": summary("multiturn", 0.50, 210, 22),
              "single": summary("single", 0.50, 60, 6)}]
    spreads = compare.across_seeds(seeds, ["pass_at_1/turn_2"])
    leap = spreads["leap"]["pass_at_1/turn_2"]
    assert (leap.mean, leap.n) == (0.375, 2)
    assert math.isclose(leap.se, 0.125)  # sample sd 0.1768 over sqrt(2)
    assert spreads["multiturn"]["pass_at_1/turn_2"].se == 0.0
    assert spreads["single"]["evaluations"].mean == 55
    assert str(leap) == "0.375 ± 0.125"
    table = compare.seeds_table(spreads, ["pass_at_1/turn_2"], 2)
    assert "| leap | 0.375 ± 0.125 | 110 ± 10 | 11 ± 1 | 50% |" in table
    assert table.endswith("(mean ± standard error over 2 seeds)")
    first, second = compare.dcp_claims(seeds, "pass_at_1/turn_2")
    # seed 0: LEAP matched multiturn (0.50) cheaper: held; seed 1: it fell short (0.25 < 0.50)
    assert first.startswith("- LEAP reaches") and "mixed here (1 of 2 seeds" in first
    assert "evaluations 1.86x fewer, wall-clock 1.91x less" in first  # 205 / 110 and 21 / 11, over the seeds' means
    # multiturn beat single on seed 0 (0.50 > 0.25), tied on seed 1: a tie is not a win
    assert "multi-turn beats single-turn" in second and "mixed here (1 of 2 seeds" in second
    one = compare.dcp_claims([seeds[0]], "pass_at_1/turn_2")
    assert all("held here (1 of 1 seeds" in line for line in one)
    assert compare.dcp_claims([{"single": seeds[0]["single"]}], "pass_at_1/turn_2") == []  # nothing to compare


def test_the_curve_over_seeds_is_the_mean_cost_and_accuracy_at_each_step_every_seed_evaluated(tmp_path):
    second = [eval_event(0, 0, 0, 0.25), eval_event(5, 300, 30, 0.25), eval_event(10, 350, 40, 0.375)]
    partial = [eval_event(0, 0, 0, 0.5), eval_event(10, 500, 60, 1.0)]  # no evaluation at step 5
    points = compare.mean_curve([{"leap": LEAP}, {"leap": second}], "leap", "pass_at_1/turn_1")
    assert [(p.step, p.evaluations, p.seconds, p.accuracy.mean, p.accuracy.n) for p in points] == [
        (0, 0, 0, 0.25, 2), (5, 200, 20, 0.375, 2), (10, 250, 30, 0.5, 2)]
    assert math.isclose(points[1].accuracy.se, 0.125) and points[0].accuracy.se == 0.0
    assert [p.step for p in compare.mean_curve([{"leap": LEAP}, {"leap": partial}], "leap", "pass_at_1/turn_1")] == [0, 10]
    assert compare.mean_curve([{"leap": LEAP}, {"multiturn": MULTI}], "multiturn", "pass_at_1/turn_1")[1].accuracy.n == 1
    assert compare.mean_curve([{"leap": LEAP}], "single", "pass_at_1/turn_1") == []
    before = compare.before_training([{"leap": LEAP, "multiturn": MULTI}, {"leap": second}], ["pass_at_1/turn_1"])
    assert (before["pass_at_1/turn_1"].mean, before["pass_at_1/turn_1"].n) == (0.25, 2)  # one value a seed
    assert compare.before_training([{"leap": LEAP[1:]}], ["pass_at_1/turn_1"])["pass_at_1/turn_1"].n == 0  # no step 0
    path = compare.plot_seeds([{"leap": LEAP, "multiturn": MULTI}, {"leap": second}], ["pass_at_1/turn_1"],
                              tmp_path / "s.png", title="t")
    assert path.is_file() and path.stat().st_size > 1000


def test_a_metric_a_run_never_logged_is_left_out_of_its_spread():
    assert compare.spread([0.5, math.nan, 0.25]).n == 2
    empty = compare.spread([math.nan])
    assert empty.n == 0 and math.isnan(empty.mean)
    assert empty.to_json() == {"mean": None, "se": None, "n": 0}  # written as null, which any JSON reader takes
    assert compare.spread([0.5, 0.25]).to_json() == {"mean": 0.375, "se": 0.125, "n": 2}


def test_the_student_claim_counts_the_seeds_where_the_student_beat_its_strongest_teacher():
    rates = [{"teacher-1": 0.5, "teacher-2": 0.25, "student-crd": 0.75},
             {"teacher-1": 0.25, "teacher-2": 0.5, "student-crd": 0.5}]  # a tie with the best: not a win
    line = compare.student_claim(rates, [["teacher-1", "teacher-2"]] * 2, "student-crd", "held-out tasks")
    assert line.startswith("- the student-crd student beats its strongest teacher on the held-out tasks: mixed here")
    assert "(1 of 2 seeds; 0.625 ± 0.125 against 0.500 ± 0.000)" in line
    assert compare.seed_dir(compare.Path("out"), 4, 1) == compare.Path("out")
    assert compare.seed_dir(compare.Path("out"), 4, 3) == compare.Path("out/seed-4")
