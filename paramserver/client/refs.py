"""Model references, the one grammar: ``MODEL:TAG``, ``MODEL@N`` (version number N), ``MODEL``
(its latest version). ``@`` for numbers because a tag may itself be called ``v3``."""
from __future__ import annotations

import re
from dataclasses import dataclass

from paramserver.client.errors import BadModelRef as BadModelRef  # re-exported: its old home

_REF = re.compile(r"^(?P<model>[^:@\s]+)(?::(?P<tag>[^:@\s]+)|@(?P<version>[0-9]+))?$")


MAX_VERSION = (1 << 63) - 1  # version numbers are int64 on the wire


@dataclass(frozen=True)
class ModelRef:
    model: str
    tag: str | None = None
    version: int | None = None  # None with no tag: the latest version

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        m = _REF.match(text.strip()) if isinstance(text, str) else None
        if m is None or (m["version"] is not None and not 1 <= int(m["version"]) <= MAX_VERSION):
            raise BadModelRef(
                f"model reference {text!r} is not MODEL:TAG (e.g. resnet50:prod), MODEL@VERSION (e.g. resnet50@3, "
                f"1 <= VERSION <= {MAX_VERSION}) or MODEL"
            )
        if m["version"] is not None:
            return cls(m["model"], None, int(m["version"]))
        return cls(m["model"], m["tag"], None)

    def __str__(self) -> str:
        if self.tag is not None:
            return f"{self.model}:{self.tag}"
        return f"{self.model}@{self.version}" if self.version is not None else self.model


def parse_ref(text: str) -> ModelRef:
    return ModelRef.parse(text)


__all__ = ["BadModelRef", "ModelRef", "parse_ref"]
