"""Checkpoint I/O of every family: the self-describing checkpoint folder (``checkpoint``), a
train.py run / step folder as its readers see it (``folders``), megatron dist checkpoints read
with nothing unpickled (``dist_load``) and the TP / PP / EP slicing of whole weights
(``sharding``)."""
