"""The converters: one module per source dataset (Mantis-Instruct, InfoVQA, LLaVA-Video-178K) and
the pipeline that turns its rows into Megatron-Energon webdataset shards, accounting for every
row (a sample or a reject with its reason): ``python -m converters <dataset> --source --out``."""
