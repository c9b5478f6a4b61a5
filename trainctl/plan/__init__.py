"""plan layer: pure arithmetic over a run spec (no torch, no numpy). Parameter counts and FLOPs per token
come from trainctl.model_shape (docs/design/memory.md, "MFU convention").

placement  rank placement and process groups (Megatron order), shared with the trainer
pipeline   layers per pipeline stage (shared with the trainer); split: its fast twin for --auto
memory     model states per ZeRO stage, activations per Korthikanti et al. 2022
schedule   pipeline bubble and micro-batches in flight per schedule
comm       collective volumes and link classes
estimate   Evaluator: one layout -> all figures (the roofline); used by plan and --auto
checks     warnings with codes and levels
plan       build_plan(spec) -> Plan, Plan.to_json()
auto       the --auto search; best_layout: its first row without scoring every layout (step and memory floors)
scale      --auto --nodes: each node count's best layout, the whole run's days and GPU-hours, the Pareto front
rates      where the times come from: catalog peak x assumptions, or a calibration profile's measured rates
calibration/  the calibration profile (`trainctl calibrate`): GEMM shapes, fits, schema, load and check
"""
