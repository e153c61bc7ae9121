"""The neutral layer that the data side (``energon_tasks``, ``converters``) and the model side
(``models``) both import, and that imports nothing of the project: the family names
(``contract.families``), the batch contract (``contract.batch``: the typed sample and batch,
``contract.constants``: its constants), the user-facing error types (``contract.errors``) and how
a product command reports them and its progress (``contract.cli``, ``contract.console``).
docs/internals/architecture.md, "Families and the shared contract".
"""
