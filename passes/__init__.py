"""Graph passes of autopar, one per file; each module exposes run(gm, ctx) -> gm."""
