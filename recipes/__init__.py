"""The recipe layer: what wires the data side (energon_tasks) to the models for a run.

It owns the run config (``run_config``: YAML + ``key=value`` overrides of train.py / eval.py) and
the training loop's pieces, one module per concern: ``layout`` (TP x PP x CP x EP x DP, process
groups), ``data`` (tokenizer, dataset and split checks, first-batch probe), ``schedule`` (LR,
loss normalisation), ``metrics`` (throughput, FLOPs, the metrics log), ``checkpointing`` (the
training checkpoint and its safe state files), ``run_folder`` (the run guard, stop signals);
eval.py's pieces (``evaluation``), the benchmark scores (``scores``) and the training report
(``report``). It may import every other room (contract, energon_tasks, models); none of them
imports it (tests/test_import_graph.py). train.py and eval.py are its two entry points.
"""
