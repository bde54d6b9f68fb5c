"""``kvcellar bench``: reproducible benchmark scenarios.

Each scenario is a module of this package with the same small surface (see
``registry.py``): ``NAME``, ``add_arguments(parser)``, ``run(args) -> dict`` and
``plot(result, out_dir)``. The command line (``cli.py``) prints the result's tables,
saves it as JSON and asks the module for its plots. Server scenarios measure any
OpenAI-compatible server over HTTP (``targets.py``), so kvcellar and a peer run the same
workload in one run.
"""
