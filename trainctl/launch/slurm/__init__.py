"""The Slurm launch backend (trainctl.launch.backend), one module per job. No torch.

    backend.py         the Backend: what `launch`, `resume`, `status`, `logs` and `cancel` do on Slurm
    render.py          a spec -> the sbatch request and script (what --dry-run prints); value vetting
    sbatch_template.py the script's text (pure: no Slurm, no spec)
    cluster.py         sinfo: partitions, nodes, GPUs, time limits; what makes a job impossible here
    submit.py          creating the run directory, sbatch, resubmission, scancel
    job_state.py       Slurm's job state names and what they mean; a job's state (scontrol, jobcomp, sacct)
    tools.py           calling Slurm's commands (argv lists, never a shell; a time limit on each)

We call sbatch/sinfo/squeue/scontrol directly rather than through submitit: submitit pickles a Python
callable and owns the script, while we need a plain, reviewable sbatch script (the user's record of the
run) with our own preemption/requeue chain, and srun/torchrun modes.
"""

NAME = "slurm"  # launcher.backend and job.json "backend" of runs this backend starts
