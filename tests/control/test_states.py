import pytest

from runyard.control.states import (
    TRANSITIONS,
    FailureReason,
    IllegalTransition,
    JobState,
    check_transition,
    classify_exit,
)

S = JobState


def test_every_state_has_a_row_and_terminal_states_only_requeue():
    assert set(TRANSITIONS) == set(JobState)
    for state in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        assert TRANSITIONS[state] == {S.PENDING}


@pytest.mark.parametrize(("current", "target"), [
    (S.PENDING, S.RUNNING),  # must pass through starting (allocation is recorded there)
    (S.SUCCEEDED, S.RUNNING),
    (S.CANCELLING, S.RUNNING),
    (S.PREEMPTED, S.RUNNING),  # back through pending: it queues like anyone else
])
def test_illegal_transitions_are_refused_with_what_is_allowed(current, target):
    with pytest.raises(IllegalTransition, match=f"cannot go from {current} to {target}") as caught:
        check_transition(1, current, target)
    assert str(caught.value).endswith(f"(from {current}: {', '.join(sorted(TRANSITIONS[current]))})")
    assert (caught.value.current, caught.value.target) == (current, target)


@pytest.mark.parametrize(("rc", "sig", "expected"), [
    (0, None, (S.SUCCEEDED, None)),
    (4, None, (S.PENDING, None)),
    (2, None, (None, FailureReason.BAD_SPEC)),
    (3, None, (None, FailureReason.GATE_FAILED)),
    (5, None, (None, FailureReason.OUT_OF_MEMORY)),
    (7, None, (None, FailureReason.NOT_FIT_TO_SHIP)),  # finished, not fit: not infra, not retried
    (1, None, (None, FailureReason.USER_ERROR)),
    (17, None, (None, FailureReason.USER_ERROR)),
    (None, 9, (None, FailureReason.INFRA)),
    (137, None, (None, FailureReason.INFRA)),
])
def test_exit_codes_classify_by_the_contract_in_errors_py(rc, sig, expected):
    assert classify_exit(rc, sig) == expected
