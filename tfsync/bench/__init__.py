"""Benchmarks: ``python -m tfsync.bench [training|ops|scheduler] ...``.

``training`` (the default) launches Horovod workers and compares synchronization
modes; ``ops`` times the fused TensorFlow ops against composed stock ops;
``scheduler`` times the ZipLine barrier decision.  Each prints a table and
writes JSON records with ``--json PATH``.
"""
