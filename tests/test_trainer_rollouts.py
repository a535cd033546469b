"""Pure LEAP-step helpers against hand-computed values."""

from leap import prompts
from leap.learning.data import draw_tasks
from svc_trainer.rollouts import (Outcome, correct_by_turn, expanded_share, mean_speedup_of_correct,
                                  next_turn, pass_at_1_by_turn, step_metrics)

WRONG, RIGHT = Outcome(False), Outcome(True, 2.0)


def test_correct_by_turn_carries_the_last_result_forward():
    assert correct_by_turn([WRONG, RIGHT], 3) == [False, True, True]
    assert correct_by_turn([RIGHT], 2) == [True, True]
    assert correct_by_turn([WRONG], 2) == [False, False]


def test_pass_at_1_by_turn_hand_computed():
    trajectories = [[WRONG, RIGHT], [RIGHT], [WRONG, WRONG], [WRONG]]
    assert pass_at_1_by_turn(trajectories, 2) == [0.25, 0.5]
    assert pass_at_1_by_turn([], 2) == [0.0, 0.0]


def test_speedup_counts_only_correct_answers():
    assert mean_speedup_of_correct([[WRONG, Outcome(True, 3.0)], [Outcome(True, 1.0)], [Outcome(False, 9.0)]]) == 2.0
    assert mean_speedup_of_correct([[WRONG]]) == 0.0


def test_expanded_share_and_step_metrics():
    assert expanded_share([True, False, False, True]) == 0.5
    assert expanded_share([]) == 0.0
    values = step_metrics([[WRONG, RIGHT], [RIGHT]], [True, False], 2)
    assert values == {"pass@1/turn1": 0.5, "pass@1/turn2": 1.0, "speedup/mean_correct": 2.0,
                      "dcp/expanded_share": 0.5, "sandbox/evaluations": 3.0}


def test_next_turn_appends_answer_then_feedback():
    history = [prompts.user("write it")]
    dialogue = next_turn(history, "```c\nx\n```", "does not compile")
    assert dialogue[0] == history[0] and len(dialogue) == 3
    assert dialogue[1] == prompts.assistant("```c\nx\n```") and dialogue[2] == prompts.user("does not compile")
    assert len(history) == 1


def test_draw_tasks_resumes_from_the_cursor_and_covers_each_epoch():
    ids = [f"t{i}" for i in range(5)]
    first, cursor = draw_tasks(ids, 3, 0, seed=7)
    second, cursor = draw_tasks(ids, 3, cursor, seed=7)
    assert cursor == 6
    assert sorted(first + second[:2]) == ids  # one full epoch before any repeat
    whole, _ = draw_tasks(ids, 6, 0, seed=7)
    assert whole == first + second  # resuming at the cursor gives the same batches
    assert draw_tasks(ids, 5, 0, seed=8)[0] != draw_tasks(ids, 5, 0, seed=7)[0]  # another seed, another order
