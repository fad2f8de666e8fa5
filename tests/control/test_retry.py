from runyard.control.retry import ClassBudget, RetryPolicy, decide
from runyard.control.states import FailureReason as F

POLICY = RetryPolicy(infra=ClassBudget(retries=3, backoff_s=2, backoff_factor=2, backoff_max_s=5),
                     user_error=ClassBudget(retries=1), window_s=100)


def test_infra_has_its_own_generous_budget_with_capped_backoff():
    fails = []
    delays = []
    for i in range(4):
        fails.append([10.0 + i, "infra"])
        d = decide(POLICY, F.INFRA, None, fails, 20.0)
        delays.append(d.delay_s if d.retry else None)
    assert delays == [2, 4, 5, None]
    final = decide(POLICY, F.INFRA, None, fails, 20.0).final_reason
    assert "infra" in final and "retry budget spent" in final and "4 infra failures within 100s" in final


def test_user_error_budget_is_separate_from_infra():
    fails = [[1.0, "infra"], [2.0, "infra"], [3.0, "user_error"]]
    assert decide(POLICY, F.USER_ERROR, 1, fails, 4.0).retry
    fails.append([5.0, "user_error"])
    d = decide(POLICY, F.USER_ERROR, 1, fails, 6.0)
    assert not d.retry and "user_error: exit 1; retry budget spent (2 user_error failures" in d.final_reason


def test_failures_outside_the_window_do_not_count():
    fails = [[0.0, "user_error"], [150.0, "user_error"]]
    assert decide(POLICY, F.USER_ERROR, 1, fails, 150.0).retry


def test_allow_list_and_never_retried_classes():
    policy = RetryPolicy.from_dict({"user_error": {"retries": 5, "retry_exit_codes": [75]}})
    assert decide(policy, F.USER_ERROR, 75, [[0, "user_error"]], 1).retry
    d = decide(policy, F.USER_ERROR, 1, [[0, "user_error"]], 1)
    assert not d.retry and "not in the retry list [75]" in d.final_reason
    for reason in (F.BAD_SPEC, F.GATE_FAILED, F.NOT_FIT_TO_SHIP):
        assert not decide(policy, reason, 2, [[0, str(reason)]], 1).retry


def test_a_job_past_its_memory_limit_is_not_retried_even_with_an_infra_budget_left():
    oom = decide(POLICY, F.OUT_OF_MEMORY, 5, [[0, "out_of_memory"]], 1)
    assert not oom.retry and "memory limit" in oom.final_reason and "ask for more memory" in oom.final_reason
    assert decide(POLICY, F.INFRA, None, [[0, "infra"]], 1).retry  # a bare SIGKILL still is


def test_policy_round_trips_and_rejects_unknown_keys():
    assert RetryPolicy.from_dict(POLICY.to_dict()) == POLICY
    try:
        RetryPolicy.from_dict({"infra_retries": 3})
    except ValueError as exc:
        assert "infra_retries" in str(exc)
    else:
        raise AssertionError("unknown key accepted")
