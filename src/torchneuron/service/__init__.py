"""The shared compile service: one process per host compiles for every
torchneuron process, merging identical requests (`torchneuron compile-service`).

This room is the server; its client and wire format are a cache layer
(cache/service_client.py, cache/service_protocol.py), re-exported here."""

from ..cache.service_client import ServiceUnavailable, service_client
from ..cache.service_protocol import default_address

__all__ = ["ServiceUnavailable", "default_address", "service_client"]
