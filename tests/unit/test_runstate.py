"""The first cause of a failed attempt from torchrun's own record (rundir/runstate.py)."""

from __future__ import annotations

from trainctl.rundir.runstate import lost_peer_ranks, torchrun_root_cause


def _entry(rank: int, code: int, sig: str = "") -> str:
    tail = f" ({sig})" if sig else ""
    return (f"[{rank}]:\n  time      : 2026-11-24_16:38:1{rank}\n  host      : node{rank}\n"
            f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {100 + rank}){tail}\n"
            "  error_file: <N/A>\n")


def _block(failures: list[str], root: str) -> str:
    """torchrun 2.x's ChildFailedError text: the other failures, then the first observed one."""
    others = "".join(failures) or "  <NO_OTHER_FAILURES>\n"
    return (f"====\ntrainer FAILED\n----\nFailures:\n{others}----\nRoot Cause (first observed failure):\n{root}"
            "====\n")


def test_the_root_cause_entry_names_the_rank() -> None:
    cause = torchrun_root_cause(_block([], _entry(3, -9, "SIGKILL")))
    assert (cause.kind, cause.rank, cause.host) == ("signal", 3, "node3") and "SIGKILL" in cause.message


def test_a_survivor_that_lost_its_peer_is_not_the_cause() -> None:
    """Rank 1 was SIGKILLed; rank 0 raised on the closed connection and torchrun dated its error file first."""
    events = [{"event": "failure", "rank": 0, "error": "RuntimeError: Connection closed by peer [127.0.0.1]:1"}]
    console = _block([_entry(1, -9, "SIGKILL")], _entry(0, 1))
    assert lost_peer_ranks(events) == {0}
    cause = torchrun_root_cause(console, lost_peer_ranks(events))
    assert (cause.kind, cause.rank) == ("signal", 1)
    # without the events' word on rank 0, torchrun's root cause stands
    assert torchrun_root_cause(console).rank == 0


def test_restarts_left_count_torchruns_own_and_none_under_srun(tmp_path) -> None:
    """What `status` tells of a rank's failure while the job runs: torchrun restarts the workers
    launcher.max_restarts times in an attempt (each trainer start records its number); srun restarts none."""
    from trainctl.launch.status import restarts_left
    from trainctl.rundir.paths import RunPaths

    paths = RunPaths(tmp_path)
    started = [{"event": "start", "torchrun_restart": 0}, {"event": "failure"},
               {"event": "start", "torchrun_restart": 1}]
    paths.spec.write_text("name: x\nlauncher: {mode: torchrun, max_restarts: 3}\n")
    assert restarts_left(paths, started[:1]) == 3 and restarts_left(paths, started) == 2
    paths.spec.write_text("name: x\nlauncher: {backend: slurm, mode: srun, max_restarts: 3}\n")
    assert restarts_left(paths, started[:1]) == 0
    paths.spec.write_text("name: x\n")  # the default: no restart
    assert restarts_left(paths, started[:1]) == 0
