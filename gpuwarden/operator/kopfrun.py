"""``kopf run -m gpuwarden.operator.kopfrun``: the operator under Kopf's own command line, with the
deployment contract's defaults (a development path; the product runs ``gpuwarden operator``).

Kopf's command line runs its default registry, so importing this module makes the operator's
(:data:`gpuwarden.operator.handlers.registry`) the default: the one import of the operator with an
effect on Kopf.
"""

from __future__ import annotations

import kopf

from gpuwarden.operator.handlers import registry

kopf.set_default_registry(registry)
