"""fedagent: an edge daemon for federated learning over MQTT with mutual TLS."""

__version__ = "0.1.0"
