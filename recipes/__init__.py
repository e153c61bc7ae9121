"""The recipe layer: what wires the data side (energon_tasks) to the models for a run.

It owns the run config (``run_config``: YAML + ``key=value`` overrides of train.py / eval.py), the
training loop's pieces (``training``: layout checks, data probe, schedule, metrics, checkpoints),
the benchmark scores (``scores``) and the training report (``report``). It may import every other
room (contract, energon_tasks, models); none of them imports it (tests/test_import_graph.py).
train.py and eval.py are its two entry points.
"""
