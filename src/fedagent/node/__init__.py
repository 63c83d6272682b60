"""What every fedagent daemon runs, agent or coordinator: the MQTT transport with mutual
TLS, signed and chunked messaging, mDNS discovery, the local control socket, sd_notify,
and the small shared pieces (logging, presence, timers, history)."""
