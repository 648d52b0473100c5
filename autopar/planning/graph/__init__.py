"""The strategy graph: per node the layouts the solver picks among, the edges and their prices.

Entry point: :func:`~autopar.planning.graph.strategy_graph.build_strategy_graph`; then
``edge_costs.cost_tables`` (the ILP's vectors and matrices), ``tying`` (repeated blocks share
variables), ``axis_groups`` (meshes of many axes), and what a laid-out graph implies:
``laid_out``, ``storages``, ``gradient_sums``. Imports ``planning.cost`` only."""
