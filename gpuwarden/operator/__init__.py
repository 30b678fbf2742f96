"""gpuwarden.operator: the Kopf operator (report ingestion, policy evaluation, Events, status).

``kopf run -m gpuwarden.operator`` registers the handlers by importing this package;
``gpuwarden operator`` runs the same handlers with the deployment contract's flags.
"""

from gpuwarden.operator import handlers

__all__ = ["handlers"]
