"""The intermediate representation every phase shares: meshes, layouts, errors, options,
the ``node.meta`` keys with their accessors, the op vocabulary, graph printing and the
plan (the data the planner hands the passes and the runtime). Imports nothing else of autopar."""
