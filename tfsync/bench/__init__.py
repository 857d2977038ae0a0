"""Benchmarks: ``python -m tfsync.bench [training|ops|scheduler|convergence|network|elastic|control] ...``.

``training`` (the default) launches Horovod workers and compares synchronization
modes; ``ops`` times the fused TensorFlow ops against composed stock ops;
``scheduler`` times the ZipLine barrier decision; ``convergence`` runs the
convergence study; ``network`` trains across two simulated hosts with a
rate-limited link; ``elastic`` measures what a lost worker costs under horovodrun's
elastic launcher, per mode and under a kill loop; ``control`` loads rank 0's control service
with hundreds of simulated workers.  Each prints a table and
writes JSON records with ``--json PATH``.
"""
