"""Search: the ILP and the searches that call it.

Entry points: :class:`~autopar.planning.search.solver.StrategyILP` (the ILP written as maths),
:func:`~autopar.planning.search.memory_search.memory_search` (ZeRO stages and recompute until
the plan fits), ``mesh_search`` (a mesh for a device count); ``memory_tables`` holds the memory
terms of the ILP, ``forked`` runs planning calls side by side. Imports every package above."""
