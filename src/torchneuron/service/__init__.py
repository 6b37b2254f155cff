"""The shared compile service: one process per host compiles for every
torchneuron process, merging identical requests (`torchneuron compile-service`)."""

from .client import ServiceUnavailable, service_client
from .protocol import default_address

__all__ = ["ServiceUnavailable", "default_address", "service_client"]
