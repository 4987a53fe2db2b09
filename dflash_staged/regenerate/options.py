"""What a ``dflash regenerate`` run is asked to do: the generation settings both paths share
(:class:`GenOptions`) and the settings of the path through servers (:class:`ServerOptions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_staged.chat import ChatOptions
from dflash_staged.config import TargetConfig


@dataclass
class GenOptions:
    target: TargetConfig
    out: Path
    devices: list[str]
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    chat: ChatOptions = field(default_factory=ChatOptions)

    def sampling(self) -> dict:
        """The sampling settings, as every record's ``regenerated.sampling`` holds them."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


DEFAULT_CONCURRENCY = 64  # conversations in flight per server that does not say how many it batches


@dataclass
class ServerOptions:
    urls: list[str]
    concurrency: int | None = None  # conversations in flight per server; None: sized to the server
    api_key_env: str | None = None  # the environment variable holding the API key
    served_model: str | None = None  # the name to request; None: the served model matching the target
    max_attempts: int = 8  # tries of one request against a live server before its conversation is skipped
    server_wait_s: float = 600.0  # how long a server that refuses connections is waited for
    allow_skipped: bool = False  # write OUT without the conversations that were skipped
    request_timeout_s: float = 3600.0  # one answer may take this long
