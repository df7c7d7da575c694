"""Every limit and timeout of the config service: the flags of ``heron config`` (and of
``python -m heron.config_service``) and their HERON_CONFIG_* variables
(heron.runtime.settings; the reference table in docs/operations.md is checked against it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from heron.runtime.settings import Settings, setting, stream_replicas_setting

# config_service/body.py and config_service/service.py hold the same numbers
# (tests/unit/test_settings.py checks); kept apart so that the command's parser stays light.
MAX_CONFIG_BYTES = 1 << 20
PUBLISH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class ConfigServiceSettings(Settings):
    env_prefix: ClassVar[str] = "HERON_CONFIG_"

    lease_ttl_s: float = setting(
        5.0, "Seconds the writer lease lasts without renewal (renewed every third of it); "
             "the same on every instance", above=0, aliases=("--lease-ttl",))
    max_body_bytes: int = setting(
        MAX_CONFIG_BYTES, "Largest POST /v1/configs/models body, before 413 "
                          "PAYLOAD_TOO_LARGE", minimum=1, size=True)
    publish_timeout_s: float = setting(
        PUBLISH_TIMEOUT_S, "Wait for the acknowledgement of one delta published to "
                           "HERON_CONFIG (retried until it comes)", above=0)
    stream_replicas: int = stream_replicas_setting()
