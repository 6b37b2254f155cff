"""The package version, in a leaf every layer may read (cache keys, the
compile service's health report) without importing the public API."""

__version__ = "0.1.0"
