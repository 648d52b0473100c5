"""Runtime: the collectives, the distributed module, gradient buckets, the ZeRO/offload optimizer
and the pipeline runtime. It runs a lowered program; it never plans (no import of the planner)."""
