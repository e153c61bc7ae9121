"""The neutral layer that the data side (``energon_tasks``, ``converters``) and the model side
(``models``) both import, and that imports nothing of the project: the family names
(``contract.families``), the batch contract's constants (``contract.constants``) and the
user-facing error types (``contract.errors``). docs/architecture.md, "Families and the shared
contract".
"""
