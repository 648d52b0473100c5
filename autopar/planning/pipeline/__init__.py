"""Pipeline parallelism at plan time: which node runs in which stage, the split into stages.

Entry point: :func:`~autopar.planning.pipeline.stage_plan.plan_pipeline` (the stages of a solved
plan and their predictions); ``stage_nodes`` places nodes, ``stage_split`` partitions units,
``in_flight`` walks torch's schedules for the microbatches a rank holds at its peak.
Imports ``planning.cost`` and ``planning.graph``."""
