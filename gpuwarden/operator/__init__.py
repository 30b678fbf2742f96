"""gpuwarden.operator: the Kopf operator (report ingestion, policy evaluation, Events, status).

Importing this package, or any module of it but :mod:`.handlers`, registers no Kopf handler:
``gpuwarden operator`` (:mod:`.command`) imports the handlers when it runs, and
``kopf run -m gpuwarden.operator.handlers`` runs them with the contract's defaults.
"""
