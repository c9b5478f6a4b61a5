"""Starting and looking after runs: the run directory, the backends, resume. No torch.

    create.py         a new run directory (frozen spec, plan, launch script, job record)
    backend.py        the Backend interface; local.py (torchrun) and slurm/ implement it
    resume.py         `trainctl resume`: which checkpoint, which spec changes are allowed
    status.py         what `status` and `runs` show; runlock.py one job per run directory
    environment.py, secrets.py, extras.py, package_origin.py   what the ranks start in
    preflight.py, node_health.py, exclusions.py, calibrate.py, worker_job.py   the measuring jobs
    diskspace.py, device_check.py, procs.py, repair.py   checks and repairs around a launch
"""
