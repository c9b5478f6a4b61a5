"""Whose a checkpoint directory is (trainctl/checkpoint/owner.py), case by case on real directories: the rules
`trainctl resume` and every rank apply. The end-to-end cases (a `cp -a` copy, a fresh launch into another run's
directory) are in tests/dist/test_run_dir_safety.py; here, what only a moved or an old run shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainctl.checkpoint import owner
from trainctl.errors import UsageError


def make_run(root: Path, run_id: str | None) -> dict[str, object]:
    root.mkdir(parents=True)
    job: dict[str, object] = {"backend": "local", **({"run_id": run_id} if run_id else {})}
    (root / "job.json").write_text(json.dumps(job))
    return job


def a_checkpoint(ckdir: Path, step: int = 4) -> None:
    (ckdir / f"step-{step:08d}").mkdir(parents=True)


def test_the_run_that_made_it_writes_there_and_the_record_stays(tmp_path: Path) -> None:
    run, ckdir = tmp_path / "run", tmp_path / "ck"
    job = make_run(run, "aaa")
    owner.write_owner(ckdir, "aaa", run)
    a_checkpoint(ckdir)
    claim = owner.for_resume(ckdir, run, job, [])
    assert (claim.run_id, claim.write, claim.note) == ("aaa", False, None)
    assert owner.problem(ckdir, run, job) is None


def test_another_runs_directory_is_refused_by_resume_and_by_every_rank(tmp_path: Path) -> None:
    other, run, ckdir = tmp_path / "other", tmp_path / "run", tmp_path / "ck"
    make_run(other, "bbb")
    owner.write_owner(ckdir, "bbb", other)
    a_checkpoint(ckdir)
    job = make_run(run, "aaa")
    with pytest.raises(UsageError, match=f"belongs to another run, {other}"):
        owner.for_resume(ckdir, run, job, [])
    assert f"belongs to run {other}" in (owner.problem(ckdir, run, job) or "")


def test_a_moved_run_directory_takes_its_checkpoint_directory_with_a_note(tmp_path: Path) -> None:
    old, new, ckdir = tmp_path / "old", tmp_path / "new", tmp_path / "ck"
    job = make_run(old, "aaa")
    owner.write_owner(ckdir, "aaa", old)
    a_checkpoint(ckdir)
    old.rename(new)  # mv: the recorded run directory is gone
    claim = owner.for_resume(ckdir, new, job, [])
    assert claim.write and "which is gone" in (claim.note or "")
    claim.apply(ckdir, new)
    assert owner.read_owner(ckdir) == owner.Owner("aaa", str(new), str(ckdir))
    assert owner.problem(ckdir, new, job) is None


def test_a_copied_checkpoint_directory_is_the_copys_own(tmp_path: Path) -> None:
    """`cp -a CK NEW` then `--set checkpoint.dir=NEW`: the record names CK, so NEW is nobody's live directory."""
    run, ckdir, new = tmp_path / "run", tmp_path / "ck", tmp_path / "ck-new"
    job = make_run(run, "aaa")
    owner.write_owner(ckdir, "aaa", run)
    a_checkpoint(ckdir)
    new.mkdir()
    (new / owner.OWNER).write_bytes((ckdir / owner.OWNER).read_bytes())
    claim = owner.for_resume(new, run, job, [])
    assert claim.write and claim.note is None


def test_an_old_run_without_records_adopts_its_own_directory_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    job = make_run(run, None)  # launched before run ids and owner records existed
    inside = run / "checkpoints"
    a_checkpoint(inside)
    claim = owner.for_resume(inside, run, job, [])
    assert claim.write and len(claim.run_id) == 32
    outside = tmp_path / "scratch"
    a_checkpoint(outside)
    committed = [{"event": "checkpoint_committed", "step": 4, "path": str(outside / "step-00000004")}]
    assert owner.for_resume(outside, run, job, committed).write  # its events name a checkpoint it wrote there
    with pytest.raises(UsageError, match="that this run never wrote there"):
        owner.for_resume(outside, run, job, [])


def test_a_rebuilt_job_json_gets_the_id_back_from_the_record(tmp_path: Path) -> None:
    """`resume --repair` rebuilds job.json without the run id: the record of this very run directory gives it back."""
    run, ckdir = tmp_path / "run", tmp_path / "ck"
    make_run(run, "aaa")
    owner.write_owner(ckdir, "aaa", run)
    claim = owner.for_resume(ckdir, run, {"backend": "local"}, [])
    assert (claim.run_id, claim.write) == ("aaa", False)


def test_a_fresh_launch_takes_only_an_empty_directory(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    assert owner.new_run_problem(ckdir) is None  # missing
    ckdir.mkdir()
    assert owner.new_run_problem(ckdir) is None  # empty
    (ckdir / "notes.txt").write_text("x")
    problem = owner.new_run_problem(ckdir)
    assert problem is not None and "is not empty: it holds files of another run" in problem.message


def test_a_damaged_record_is_one_line_with_the_fix(tmp_path: Path) -> None:
    run, ckdir = tmp_path / "run", tmp_path / "ck"
    job = make_run(run, "aaa")
    ckdir.mkdir()
    (ckdir / owner.OWNER).write_text("{not json")
    with pytest.raises(UsageError, match="is damaged") as e:
        owner.for_resume(ckdir, run, job, [])
    assert e.value.hint and f"remove {ckdir / owner.OWNER}" in e.value.hint
