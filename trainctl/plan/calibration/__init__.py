"""The calibration profile (`trainctl calibrate`): measured compute rates and link fits the planner prices a
layout with instead of catalog peaks times assumed efficiencies. Torch-free: the planner reads it.

shapes   the model's GEMM shapes and the TP sizes a calibration measures (what the worker times)
fit      least-squares fits: latency + bytes/bandwidth per link class and collective, FLOP/s rates
profile  the profile's JSON schema: build from raw figures, write atomically, load and check against a spec

The worker that measures is trainctl/runtime/workers/calibrate.py (torch); the refit from a finished run's step
times is trainctl/report/refit.py; docs/design/calibration.md, "Calibration profile", says how the planner uses it.
"""
