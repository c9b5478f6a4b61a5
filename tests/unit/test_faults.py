"""TRAINCTL_FAULTS, the one switch for test-only fault injection: names are checked, values round-trip."""

from __future__ import annotations

import time

import pytest

from trainctl.runtime.observe import stragglers
from trainctl.runtime.train import faults


def test_encode_parse_round_trip():
    env = faults.encode(fail_at_step=3, fail_rank=1, slow_rank="0:0.5+2:1", host_memory=10**6)
    assert list(env) == [faults.ENV]
    assert faults.active(env) == {"fail_at_step": "3", "fail_rank": "1", "slow_rank": "0:0.5+2:1",
                                  "host_memory": "1000000"}
    assert faults.get("fail_rank", env) == "1" and faults.get("hang", env) is None
    assert faults.get_int("fail_at_step", environ=env) == 3
    assert faults.get_int("stop_after_step", 7, environ=env) == 7  # not switched on: the default
    assert faults.get_float("slow_write_s", environ=env) == 0.0
    assert stragglers.slow_seconds(2, env) == 1.0 and stragglers.slow_seconds(1, env) == 0.0


def test_slow_work_burns_the_steps_cpu_time_factor_minus_one_times_more():
    """slow_work=<rank>:<factor>: the rank's step costs `factor` times its work in CPU time (a slow device),
    so it stays a straggler on a loaded host; other ranks and runs without the fault are untouched."""
    env = faults.encode(slow_work="1:3+2:1.5")
    assert stragglers.slow_factor(1, env) == 3.0 and stragglers.slow_factor(0, env) == 1.0
    untouched = stragglers.InjectedStraggler(0, env)
    assert untouched.factor == 1.0 and untouched.sleep_s == 0.0
    slow = stragglers.InjectedStraggler(1, env)
    slow.before_work()
    t0 = time.process_time()  # after before_work's own reading: the burn multiplies what came after that
    stragglers.burn_cpu(0.05)  # the step's own work
    work = time.process_time() - t0
    slow.after_work()
    assert time.process_time() - t0 >= 3 * work
    with pytest.raises(ValueError, match="slow_work"):
        stragglers.InjectedStraggler(1, faults.encode(slow_work="one:3"))


def test_unknown_or_malformed_fault_is_an_error():
    with pytest.raises(faults.FaultSpecError, match="fail_at_stpe"):
        faults.active({faults.ENV: "fail_at_stpe=3"})  # a typo must not silently switch the fault off
    with pytest.raises(faults.FaultSpecError, match="name=value"):
        faults.active({faults.ENV: "fail_at_step"})
    with pytest.raises(KeyError):
        faults.encode(no_such_fault=1)
    with pytest.raises(KeyError):
        faults.get("no_such_fault", {})


def test_nothing_switched_on_by_default(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.active() == {}
    assert all(faults.get(name) is None for name in faults.FAULTS)
