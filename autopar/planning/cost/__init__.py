"""Cost: the hardware's figures and how long a plan's compute and communication take.

Entry point: :class:`~autopar.planning.cost.model.CostModel` (built from a
:class:`~autopar.planning.cost.cluster.Cluster`, a preset or a cluster file: ``get_cluster``).
``device_model`` what a device spends beyond the roofline and the links (the CPU-gloo terms
behind one interface); ``step_overheads`` prices what a step spends beyond ops and layout
changes; ``update_cost`` the update modes under stragglers. Imports nothing else of planning."""
