"""Every example in README.md and the docs/ pages, run as a user would follow them: the README top to bottom,
then the pages in the walkthrough's order (tests/readme_walkthrough.py, PAGES), in one working directory.

- A `$ trainctl ...` line of a ```text block is run as written; the lines under it are what the page says
  it prints, and they must appear in the output in that order (the page may leave lines out, and `...` in
  a line stands for any text). Spacing is compared loosely (tables pad columns). In a command that measures
  something (it trains, times, scans or prices with a measured profile) a figure with a unit of time or
  size, a decimal, a percentage, a throughput and a date or time stamp may differ from the page's; every
  other number (steps, ranks, counts, exit codes) must be exactly the page's.
- A `trainctl ...` line of a ```bash block must run and exit 0. Those that would train run with --dry-run
  (the `$` examples train the same recipes for real); the Llama 3 70B recipe's Slurm cluster is not this
  machine's (no sinfo query of the shared test cluster; its data, not here either, is what its dry run warns
  about). ADAPTED says so.
- Exit codes other than 0 are the ones the pages name (EXIT).

The quick run the walkthrough builds (launch, then resume) is also checked in depth (test_quick_run_directory).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
import yaml
from cli_utils import trainctl
from readme_walkthrough import VARYING, VARYING_RE, Example, Walkthrough, all_examples

from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.spec import load_spec, resolved_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

EXIT = {  # what the pages say these exit with
    "trainctl validate recipes/llama3-8b.yaml --set parallel.micro_batch=3": 2,
    "trainctl validate recipes/llama3-70b.yaml --set parallel.tp=16 --set parallel.dp=4": 2,
    "trainctl data check sample.bin --vocab 100": 1,
    "trainctl launch --set train.lr=1e9 --set train.grad_clip=null --set checkpoint.every_steps=1": 3,
    "trainctl sweep --grid train.lr=1e-3,abc --grid train.bogus=1 --grid train.seed=1,2 --grid train.seed=3": 2,
}


def normal(line: str) -> str:
    return " ".join(line.replace("┃", "│").split())


def pattern(expected: str, measuring: bool) -> re.Pattern[str]:
    """The page's line as a regex: literal text; `...` any text; in a measuring command also the varying
    figures (see the module docstring)."""
    out, pos = [], 0
    for m in VARYING_RE.finditer(expected):
        group = next(i for i, g in enumerate(m.groups()) if g is not None)
        if group != 0 and not measuring:
            continue  # an exact command: only `...` stands for something else
        out += [re.escape(expected[pos:m.start()]), VARYING[group][1]]
        pos = m.end()
    out.append(re.escape(expected[pos:]))
    return re.compile("".join(out))


def mismatch(ex: Example, output: str) -> str | None:
    """None when every line the page shows appears in `output`, in order; else what is missing, with context."""
    lines = [normal(x) for x in output.splitlines()]
    at = 0
    for want in ex.expected or []:
        w = normal(want)
        if w in ("...", "…"):
            continue
        rx = pattern(w, ex.measuring)
        hit = next((i for i in range(at, len(lines)) if rx.fullmatch(lines[i])), None)
        if hit is None:
            seen = "\n    ".join(lines[at:at + 12])
            return f"{ex.where}: `{ex.command}` did not print\n    {w}\n  after that point it printed\n    {seen}"
        at = hit + 1
    return None



def test_the_examples_are_all_found() -> None:
    found = all_examples()
    commands = [ex.command.split()[1] for ex in found]
    for cmd in ("validate", "plan", "data", "launch", "checkpoints", "resume", "export", "calibrate", "mfu-report",
                "status"):
        assert cmd in commands, cmd
    assert sum(ex.expected is not None for ex in found) >= 12
    assert all(ex.expected for ex in found if ex.expected is not None), "a $ example shows no output"
    # an example moved from one page to another is moved, not copied: each runs once
    seen: dict[str, str] = {}
    for ex in found:
        assert ex.command not in seen, f"{ex.where} repeats {seen[ex.command]}: `{ex.command}`"
        seen[ex.command] = ex.where


# a Python traceback's first line (a Slurm dry run prints the batch script, whose log filter names the words)
PYTHON_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)


def test_every_example_does_what_its_page_says(readme_walkthrough: Walkthrough) -> None:
    results = readme_walkthrough.results
    problems = []
    for r in results:
        ex = r.example
        want = EXIT.get(ex.command, 0)
        if r.returncode != want or PYTHON_TRACEBACK.search(r.output):
            how = ex.why or "as written"
            problems.append(f"{ex.where}: `{ex.command}` ran as {shlex.join(ex.args)} ({how}) and exited "
                            f"{r.returncode}, not {want}:\n{r.output[-2000:]}")
        elif ex.expected is not None and (why := mismatch(ex, r.output)):
            problems.append(why)
    assert not problems, "\n\n".join(problems)


def test_quick_run_directory(readme_walkthrough: Walkthrough) -> None:
    """The walkthrough's runs/quick (the default recipe, 8 ranks, TP2 x PP2 x DP2: 3 steps, then resumed to 6):
    what the launch and the resume left in the run directory."""
    cwd = readme_walkthrough.cwd
    paths = RunPaths((cwd / "runs" / "quick").resolve())
    steps = [m["step"] for m in read_jsonl(paths.metrics)]
    assert steps == [1, 2, 3, 4, 5, 6]
    spec = load_spec(paths.spec)  # the frozen spec round-trips (as the resume rewrote it)
    assert resolved_dict(spec) == yaml.safe_load(paths.spec.read_text()) and spec.train.steps == 6
    assert load_spec(paths.previous_spec(1)).train.steps == 3
    job = json.loads(paths.job.read_text())
    assert [(a["kind"], a["status"], a["exit_code"]) for a in job["attempts"]] == [
        ("launch", "completed", 0), ("resume", "completed", 0)]
    rank_logs = sorted(p.parent.name for p in paths.logs.glob("*/attempt_0/*/stdout.log"))
    assert rank_logs == sorted([str(i) for i in range(8)] * 2)  # every rank's output is in a file, both launches
    assert (paths.logs / "launcher.log").stat().st_size > 0
    events = read_jsonl(paths.events)
    assert events[0]["event"] == "launch" and events[-1]["event"] == "launcher_exit"
    # the parameters the trainer built (TP x PP x ZeRO-1 here) are the ones the plan predicted
    starts = [e for e in events if e["event"] == "start"]
    plan = trainctl("plan", str(paths.spec), "--json")
    planned = json.loads(plan.stdout)["params"]
    assert len(starts) == 2 and all(s["params"] == {"total": planned["total"], "per_rank": planned["per_rank"]}
                                    for s in starts)
    assert planned["total"] == 217_664  # the tiny preset, LayerNorm without bias (tests/unit/test_params_built.py)
    # mfu-report holds the measured memory against the plan, per pipeline rank and component
    report = trainctl("mfu-report", str(paths.root), "--json")
    mem = json.loads(report.stdout)["runs"][0]["memory"]
    assert mem["available"] and {x["pp_rank"] for x in mem["rows"]} == {0, 1}
    for row in mem["rows"]:
        limit = 0.10 if row["component"] == "activations" else 0.01  # states: bucket padding, step counters
        assert abs(row["error"]) <= limit, row
    assert "largest gap" in mem["largest_gap"]


def test_slurm_dry_run_prints_the_script_and_warns_what_it_cannot_check(readme_walkthrough: Walkthrough) -> None:
    """The Llama 3 70B recipe's data and cluster are not on this machine: its dry run, as the README writes it,
    still prints the script, with a warning for the data file and the cluster it could not check."""
    out = readme_walkthrough.result("trainctl launch recipes/llama3-70b.yaml --dry-run").output
    assert "warning: not checked here: data.path /data/llama3/train_tokens.bin: no such file" in out
    assert "sinfo not found: cluster checks skipped" in out
    assert "#SBATCH --nodes=32" in out


def test_following_the_readme_in_the_repository_leaves_git_clean(readme_walkthrough: Walkthrough) -> None:
    """Every file the walkthrough wrote where it was followed (the token files, their caches, the calibration
    profiles, runs/) is ignored by the repository's .gitignore: a user who follows the README in the clone
    then launches runs whose job.json records `git dirty: false`."""
    from paths import REPO

    given = {"recipes", "trainctl", "tokenizer.json", "corpus.jsonl"}  # the test's own (follow())
    written = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
                     for p in readme_walkthrough.cwd.iterdir() if p.name not in given)
    assert "sample.bin" in written and "calibration-tiny-cpu.json" in written and "runs/" in written, written
    check = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *written], capture_output=True,
                           text=True, timeout=60)
    assert sorted(check.stdout.split()) == written, f"not ignored: {set(written) - set(check.stdout.split())}"

