"""Tenant GPU shares as the workers see them: a Redis hash written by the web side
(:data:`webapp.transport.keys.SHARES_KEY`), rewritten whole whenever a tenant is saved or deleted,
by ``manage.py serve`` and when a web process starts (:mod:`webapp.startup`).

Workers read the hash with every heartbeat (every ``HEARTBEAT_INTERVAL`` = 0.5 s) and pass
it to their engine when it changed, so an edit in the admin reaches running engines within
a second, without a restart. Polling (rather than pub/sub) means a worker that starts, or
reconnects after a Redis hiccup, never misses the current shares.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShares:
    """Plain numbers for the engine's scheduler (``LLMEngine.set_tenant_shares``).

    Attributes:
        shares: tenant slug -> GPU share in percent.
        priorities: tenant slug -> priority (lower goes first between equals).
    """

    shares: dict[str, float]
    priorities: dict[str, int]


def encode_share(share: float, priority: int) -> str:
    return json.dumps({"share": share, "priority": priority})


def decode_shares(raw: dict[bytes | str, bytes | str]) -> TenantShares:
    """The hash as read by ``HGETALL`` -> :class:`TenantShares` (entries that do not parse are skipped)."""
    shares, priorities = {}, {}
    for slug, value in raw.items():
        slug = slug.decode() if isinstance(slug, bytes) else slug
        try:
            entry = json.loads(value)
            shares[slug] = float(entry["share"])
            priorities[slug] = int(entry.get("priority", 0))
        except (ValueError, TypeError, KeyError):
            continue
    return TenantShares(shares, priorities)
