"""Kubernetes service discovery: the pods that match a role's selector become servers.

:mod:`.pod_rule` is the pure rule from a pod object to servers; :class:`PodsApi` lists and
watches pods; :class:`PodWatch` re-lists whenever it may have missed news; :class:`Reconciler`
makes the servers real through the fleet only. :func:`follow_pods` puts them together with the
credentials of a kubeconfig or of the pod the router runs in.

Contract: discovery changes the fleet, never the ledger or the routing directly. May import the
fleet and below.
"""

from __future__ import annotations

from .credentials import Credentials, NoCredentials, from_kubeconfig, load
from .follow import credentials, follow_pods
from .kube_api import Expired, PodsApi
from .metrics import DiscoveryMetrics
from .pod_rule import ELIGIBILITY, PodServer, ineligible, pod_ref, servers_of
from .pod_watch import BACKOFF_MAX, PodWatch
from .reconcile import Reconciler

__all__ = [
    "BACKOFF_MAX",
    "ELIGIBILITY",
    "Credentials",
    "DiscoveryMetrics",
    "Expired",
    "NoCredentials",
    "PodServer",
    "PodWatch",
    "PodsApi",
    "Reconciler",
    "credentials",
    "follow_pods",
    "from_kubeconfig",
    "ineligible",
    "load",
    "pod_ref",
    "servers_of",
]
