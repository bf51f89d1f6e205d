"""The stall watchdog in GroupServer.check_health: a step running past step_timeout_s fails
the health check (Serve then replaces the group), a step within it does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.workers.serving.group_server import DEFAULT_STEP_TIMEOUT_S, GroupServer

check_health = GroupServer.func_or_class.check_health


def server(step_running_for: float, timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> SimpleNamespace:
    failed: list[str] = []
    engine = SimpleNamespace(step_running_for=lambda: step_running_for, is_healthy=True, dead_error=None,
                             fail_stalled=failed.append, failed=failed)
    return SimpleNamespace(healer=None, engine=engine, step_timeout_s=timeout_s, group_id="g7")


def test_a_step_past_the_timeout_fails_the_health_check_and_the_groups_requests():
    assert DEFAULT_STEP_TIMEOUT_S == 30.0
    for within in (server(0.0), server(29.9)):
        check_health(within)
        assert within.engine.failed == []
    stalled = server(31.0)
    message = "replica group g7 has stalled: one step has run for 31 s (step_timeout_s 30)"
    with pytest.raises(RuntimeError, match=r"^replica group g7 has stalled: one step has run for 31 s "
                                           r"\(step_timeout_s 30\)$"):
        check_health(stalled)
    assert stalled.engine.failed == [message]  # its requests end now, not at their deadlines
    with pytest.raises(RuntimeError, match="has stalled"):
        check_health(server(2.5, timeout_s=2.0))


def test_the_timeout_is_a_serving_option_checked_at_build():
    from tandem.router.app import build_app

    assert build_app({"step_timeout_s": 5})._bound_deployment.init_args[0]._bound_deployment.init_args[1][
        "step_timeout_s"] == 5
    for bad in (0, -1, float("inf"), True, "30"):
        with pytest.raises(ValueError, match="^step_timeout_s: must be a number of seconds > 0"):
            build_app({"step_timeout_s": bad})
