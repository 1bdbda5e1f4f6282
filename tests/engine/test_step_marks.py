"""StepMarks: which recorded step start follows the writes of a slot's first tokens."""

from __future__ import annotations

import itertools

from freekv_sglang.streams import StepMarks


def marks(keep=64):
    counter = itertools.count()
    return StepMarks(lambda: f"start of step {next(counter)}", keep=keep)


def test_the_mark_after_the_step_that_wrote_the_last_token_asked_for():
    m = marks()
    m.begin([3], [101])  # step 0: slot 3's prompt of 100 tokens, then token 100
    m.begin([3, 5], [102, 41])  # step 1: token 101 (slot 5's first step)
    m.begin([3, 5], [103, 42])  # step 2: token 102
    assert m.written_by(3, 101) == "start of step 1"  # token 100: step 0
    assert m.written_by(3, 102) == "start of step 2"  # token 101: step 1
    assert m.written_by(3, 103) is None  # token 102: the last step begun; nothing follows it yet
    m.begin([5], [43])  # step 3, without slot 3 (it finished: the overlap scheduler launched it anyway, or not)
    assert m.written_by(3, 103) == "start of step 3"
    # Prompt tokens were written by the prefill, which precedes the slot's first step: that step's end is the answer.
    assert m.written_by(3, 64) == "start of step 1"
    assert m.written_by(5, 32) == "start of step 2"
    assert m.written_by(7, 32) is None  # never decoded here


def test_a_skipped_step_makes_the_answer_later_and_forget_drops_the_slot():
    m = marks()
    m.begin([3], [11])  # step 0: token 10
    m.begin([5], [50])  # step 1, slot 3 out of it
    m.begin([3], [12])  # step 2: token 11
    m.begin([3], [13])  # step 3: token 12
    # Token 10 was written in step 0; counting back from step 3 says step 1: a later mark, still after step 0's work.
    assert m.written_by(3, 11) == "start of step 2"
    m.forget(3)
    assert m.written_by(3, 11) is None


def test_marks_older_than_kept_answer_with_the_oldest_kept():
    m = marks(keep=2)
    for i in range(5):
        m.begin([1], [20 + i])  # step i writes token 19 + i
    assert m.written_by(1, 20) == "start of step 3"  # step 0's own follower (step 1) is no longer kept
    assert m.written_by(1, 23) == "start of step 4"
    none = StepMarks(lambda: None)  # CPU: nothing recorded, nothing to wait on
    none.begin([1], [20])
    none.begin([1], [21])
    assert none.written_by(1, 20) is None
