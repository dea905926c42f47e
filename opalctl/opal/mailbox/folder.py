"""The mailbox folder as both sides see it: the few operations a request, a lease and an answer need.

Every path is relative to the mailbox's root, '/'-separated, never absolute and never with '..' (refused with
``MailboxRefusal``). Whatever lies in the folder is treated as hostile: ``read`` refuses a link, a file that is not
regular and a file over its limit, and never transfers more than the limit and one byte.
"""

from __future__ import annotations

from typing import Protocol


class MailboxRefusal(Exception):
    """What lies at a mailbox path is refused (a link, not a regular file, over its limit), or the path itself is (an
    absolute path, '..'); the message says which in one sentence."""


class MailboxFolder(Protocol):
    def names(self, sub: str) -> list[str]:
        """The names of the regular files in ``sub`` (none when it is missing), without those starting with '.'."""

    def read(self, path: str, limit: int) -> bytes | None:
        """The bytes of ``path``, None when it is missing; ``MailboxRefusal`` for a link, a file that is not regular
        or one over ``limit`` bytes."""

    def create(self, path: str, data: bytes) -> bool:
        """Write ``path`` atomically only if it is absent (a temporary '.' file, then a hard link); False when it
        exists. The lease primitive."""

    def replace(self, path: str, data: bytes) -> None:
        """Write ``path`` atomically, over what is there."""

    def remove(self, path: str) -> None:
        """Remove ``path``; a missing one is fine."""

    def makedirs(self, sub: str) -> None:
        """Make the folder ``sub`` and those above it."""
