"""Example models that autopar plans and trains; each module also runs as a script.

This is a regular package (not a namespace one) so that ``import examples.gpt`` from the
repository root cannot be shadowed by an unrelated ``examples`` package in site-packages.
"""
