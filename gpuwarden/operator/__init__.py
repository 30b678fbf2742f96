"""gpuwarden.operator: the Kopf operator (report ingestion, policy evaluation, Events, status).

Importing this package, or any module of it but :mod:`.kopfrun`, registers nothing in Kopf: the
handlers go into the operator's own registry (:data:`.handlers.registry`), which ``gpuwarden operator``
(:mod:`.command`) runs, and which ``kopf run -m gpuwarden.operator.kopfrun`` makes Kopf's default
(then with the contract's defaults). Nothing of the operator is imported by the rest of gpuwarden:
``gpuwarden.cli`` runs :mod:`.command` by name (an import contract holds it).
"""

__all__: list[str] = []
