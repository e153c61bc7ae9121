"""Hugging Face model folders: what a run takes from one (``source``), the weight-mapping
machinery every family's name table uses (``weights``), the export of a checkpoint as an HF folder
(``export``) and the generated inputs of ``models.convert verify`` (``verify_inputs``). The
command line is ``python -m models.convert``."""
