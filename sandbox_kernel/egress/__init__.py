"""The egress allow-list: domain rules, the host's enforcing proxy, the in-sandbox relay.

A kernel whose network is "allowlist" has no network interface; ``relay.py`` runs inside
its sandbox, ``proxy.EgressProxy`` on the host decides and logs, by ``rules``.
"""

from sandbox_kernel.egress.proxy import ApprovalRequest, Decision, EgressProxy
from sandbox_kernel.egress.rules import DomainRule, EgressPolicy, EgressRules

__all__ = ["ApprovalRequest", "Decision", "DomainRule", "EgressPolicy", "EgressProxy", "EgressRules"]
