"""Benchmarks and research harnesses, beside the packages and outside what a user installs (the wheel holds
kernels, fscomm, fsdata, fsembed and pipelines only). They run from a source checkout, one per name:

    python -m benchmarks NAME [flags]        # python -m benchmarks: the names; NAME --help: its flags

Each prints one table and writes its records as JSON (``--json PATH``); BENCHMARKS.md gives the commands behind
every figure. Helpers that serve only them live here too: the launcher of their local ranks (launch.py), the
background traffic of the transport benches (traffic.py), the GPU trace reader (gpu_trace.py) and the balance
measures tests judge partitioners by (plan_measures.py). They may import any package; no package imports them
(tests/test_layout.py)."""
