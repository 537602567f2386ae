"""Errors of the deploy package: one root, ``DeployError``, and one class per job under it.

Each keeps the builtin base it had before the root existed (RuntimeError or ValueError), so every
``except`` that caught it still does; the modules that raise them re-export them.
"""
from __future__ import annotations

# The exit codes of the CLIs (paramserver/client/exit_codes.py), spelled out here because importing that
# module pulls in torch (about 2 s) before 'deploy.local up' or '--help' can answer.
EXIT_OTHER = 1
EXIT_BAD_ARGUMENTS = 2
EXIT_NOT_FOUND = 3
EXIT_CONFLICT = 4
EXIT_UNAVAILABLE = 6
EXIT_INTERRUPTED = 130


class DeployError(Exception):
    """Base class of every error raised by ``deploy``."""


class LauncherError(DeployError, RuntimeError):
    """The local cluster could not be started, found or stopped; ``code`` is the CLI's exit code."""

    def __init__(self, message: str, code: int = EXIT_OTHER) -> None:
        super().__init__(message)
        self.code = code


class CertError(DeployError, ValueError):
    """A certificate or key file that cannot be used; the message names the file."""


class NetnsError(DeployError, RuntimeError):
    """A namespace, veth, bridge or tc rule could not be set up or removed."""


class DrillError(DeployError, RuntimeError):
    """A drill could not run (as opposed to an invariant that broke, which the report records)."""


__all__ = [
    "EXIT_BAD_ARGUMENTS", "EXIT_CONFLICT", "EXIT_INTERRUPTED", "EXIT_NOT_FOUND", "EXIT_OTHER", "EXIT_UNAVAILABLE",
    "CertError", "DeployError", "DrillError", "LauncherError", "NetnsError",
]
