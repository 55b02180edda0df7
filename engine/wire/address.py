"""A node's TCP address, ``HOST:PORT`` on command lines."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import DeskfleetError


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise DeskfleetError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:7001)")
        return cls(host.strip("[]") or "127.0.0.1", int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"
