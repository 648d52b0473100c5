"""Planning: the strategy graph, the cost and memory models, the ILP, the memory search, the
pipeline partition and the assembly of a :class:`~autopar.ir.plan.Plan`. Planning is pure: it
reads the captured graph and returns data; it writes nothing into ``node.meta``."""
