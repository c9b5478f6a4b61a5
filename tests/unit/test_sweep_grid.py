"""`trainctl sweep`'s grid checks through the real CLI: every mistake at once, one line each, exit 2, nothing
created (so nothing submitted); the points a good grid expands to. No training here (tests/e2e/test_sweep_e2e.py)."""

from __future__ import annotations

from pathlib import Path

from cli_utils import trainctl

ONE_RANK = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=1",
            "--set", "cluster.gpus_per_node=1", "--set", "train.global_batch=4",
            "--set", "parallel.sequence_parallel=false"]


def errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")]


def test_bad_grid_names_every_mistake_once_and_creates_nothing(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for backend in ("local", "slurm"):  # slurm: refused before any sbatch (the directory is never made)
        r = trainctl("sweep", *ONE_RANK, "--set", f"launcher.backend={backend}", "--sweep-dir", str(sweep),
                     "--grid", "train.lr=1e-3,abc", "--grid", "train.bogus=1", "--grid", "train.seed=1,2",
                     "--grid", "train.seed=3", "--grid", "train.warmup=", "--grid", "parallel.tp=2",
                     "--grid", "nonsense")
        assert r.returncode == 2, r.stdout + r.stderr
        lines = errors(r.stderr)
        wanted = ["--grid train.seed=3: train.seed is given twice", "--grid train.warmup=: train.warmup has an empty",
                  "--grid 'nonsense': expected KEY=V1,V2", "--grid train.lr=abc: train.lr = 'abc'",
                  "--grid train.bogus=1: train.bogus: unknown key", "--grid parallel.tp=2: parallel.dp = 1: tp*pp*dp"]
        for want in wanted:
            assert sum(want in ln for ln in lines) == 1, (want, r.stderr)
        assert len(lines) == len(wanted), r.stderr
        assert not any("1e-3" in ln for ln in lines)  # the good value is no mistake
        assert "Traceback" not in r.stderr
        assert not sweep.exists()


def test_a_point_the_spec_refuses_is_named_by_its_values(tmp_path: Path) -> None:
    # each value alone is valid; together they break tp*pp*dp = ranks
    r = trainctl("sweep", *ONE_RANK, "--sweep-dir", str(tmp_path / "s"), "--set", "cluster.gpus_per_node=2",
                 "--set", "parallel.dp=auto", "--set", "train.global_batch=8",
                 "--grid", "parallel.tp=1,2", "--grid", "parallel.pp=1,2")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = errors(r.stderr)
    assert len(lines) >= 1 and all("grid point 3 (parallel.tp=2, parallel.pp=2)" in ln for ln in lines), r.stderr
    assert not (tmp_path / "s").exists()


def test_empty_grid_and_sweep_file(tmp_path: Path) -> None:
    r = trainctl("sweep", *ONE_RANK, "--sweep-dir", str(tmp_path / "s"))
    assert r.returncode == 2 and "no grid" in r.stderr, r.stderr
    design = tmp_path / "design.yaml"
    design.write_text("grid:\n  train.lr: [1.0e-3, 3.0e-3]\n  train.seed: [1, 2, 3]\n")
    r = trainctl("sweep", *ONE_RANK, "--sweep-dir", str(tmp_path / "s"), "--sweep-file", str(design),
                 "--grid", "train.seed=4", "--grid", "train.warmup=1,2", "--dry-run")
    assert r.returncode == 2 and "train.seed is given twice" in r.stderr, r.stderr
    r = trainctl("sweep", *ONE_RANK, "--sweep-dir", str(tmp_path / "s"), "--sweep-file", str(design),
                 "--grid", "train.warmup=1,2", "--dry-run")
    assert r.returncode == 0, r.stderr
    points = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("run-")]
    assert len(points) == 2 * 3 * 2  # the product of the grid
    assert points[0] == "run-0: train.lr=0.001, train.seed=1, train.warmup=1"
    assert points[-1] == "run-11: train.lr=0.003, train.seed=3, train.warmup=2"
    assert not (tmp_path / "s").exists()  # a dry run creates nothing


def test_slurm_grid_that_reshapes_the_job_is_refused(tmp_path: Path) -> None:
    r = trainctl("sweep", *ONE_RANK, "--set", "launcher.backend=slurm", "--sweep-dir", str(tmp_path / "s"),
                 "--grid", "cluster.cpus_per_task=1,2", "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(errors(r.stderr)) == 1 and "changes the Slurm request" in r.stderr, r.stderr


def test_slurm_dry_run_shows_the_job_array(tmp_path: Path) -> None:
    sweep = tmp_path / "s"
    r = trainctl("sweep", *ONE_RANK, "--set", "launcher.backend=slurm", "--sweep-dir", str(sweep),
                 "--grid", "train.lr=1e-3,3e-3", "--grid", "train.seed=1,2", "--max-parallel", "2", "--dry-run")
    assert r.returncode == 0, r.stderr
    (submit,) = [ln for ln in r.stdout.splitlines() if ln.startswith("sbatch ")]
    assert "--array=0-3%2" in submit and submit.endswith(f"{sweep}/array.sh")
    assert f"--output={sweep}/run-%a/logs/slurm-%j.out" in submit  # each element's log in its run's logs/
    assert not sweep.exists()
