"""The project's error tree: one root, and only the subclasses somebody catches.

Local mistakes (a bad config, a missing certificate) and remote ones (a peer sent
garbage) are kept apart so a daemon can exit on the first and merely log the second.
Each process-level error carries the exit code the daemon ends with, so systemd's
``RestartPreventExitStatus=`` can stop a restart loop on a configuration error.
"""

from __future__ import annotations

# sysexits.h values, so the codes mean something to operators and systemd units.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69
EXIT_SOFTWARE = 70
EXIT_IOERR = 74
EXIT_CONFIG = 78


class FedagentError(Exception):
    """Root of every error fedagent raises on purpose."""

    exit_code = EXIT_FAILURE


class AckWithheld(Exception):
    """What a message handler's awaitable fails with when the message it handled must not
    be acknowledged: its broker keeps it and delivers it again after the next connection
    (a coordinator that could not write an update's frame to its round journal)."""


class ConfigError(FedagentError):
    """The local configuration, certificate or key is wrong; restarting won't help."""

    exit_code = EXIT_CONFIG


class StateWriteError(FedagentError):
    """The state directory cannot be written (disk full, read-only, quota). The previous
    checkpoint is intact; a restart helps only once an operator frees space, so the
    daemon exits with its own code (EX_IOERR) and systemd's start limit bounds the loop."""

    exit_code = EXIT_IOERR


class CodecError(FedagentError):
    """Bytes from the network could not be decoded into a valid message."""


class ProtocolError(FedagentError):
    """A well-formed message that breaks the protocol (wrong round, wrong sender...)."""


class TransportError(FedagentError):
    """The broker could not be reached or refused us."""

    exit_code = EXIT_UNAVAILABLE


class CertificateRejected(TransportError):
    """The TLS handshake failed because of a certificate (ours or the broker's)."""

    exit_code = EXIT_CONFIG


class ClockBehind(TransportError):
    """A certificate (ours or the broker's) is not valid *yet* by this machine's clock:
    the clock is behind (a device without a real-time clock boots at 1970 or at its last
    shutdown, and NTP sets it later). Retried, unlike :class:`CertificateRejected`: once
    the clock is set the same certificates are fine."""


class NotAuthorized(TransportError):
    """The broker's ACL refused a publish (MQTT 5 reason code 135)."""

    exit_code = EXIT_CONFIG
