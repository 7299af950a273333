"""One load test's settings: what `python -m loadtest.run` passes to the Locust process.

The runner serialises `LoadSettings` into the environment variable `FASER_LOADTEST` (JSON) and the
locustfile reads it back, so a run is described by one object that also lands in `run.json` beside
the results. A few settings have their own environment variables for running `locust -f
loadtest/locustfile.py` by hand: `FASER_SHAPE`, `FASER_PROMPTS`, `FASER_SPECULATION`,
`FASER_MODEL`, `FASER_RECORDS`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SETTINGS_ENV = "FASER_LOADTEST"
# the server's API key, sent as a Bearer token; kept out of the settings, which run.json keeps
API_KEY_ENV = "OPENAI_API_KEY"
SHAPES = ("step", "spike", "diurnal", "trace")

# Single-field environment variables, for hand-run locust; the JSON blob wins over nothing else.
_ENV_FIELDS = {
    "FASER_SHAPE": "shape",
    "FASER_PROMPTS": "prompts_path",
    "FASER_SPECULATION": "speculation",
    "FASER_MODEL": "model",
    "FASER_RECORDS": "records_path",
}


class LoadSettings(BaseModel):
    """Everything one run needs; unknown or ill-typed fields fail with the field's name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The request.
    api: Literal["chat", "completions"] = "chat"
    model: str | None = None  # None: the first entry of the server's /v1/models
    max_tokens: int = Field(128, ge=1)  # closed-loop shapes; trace replay takes the trace's
    ignore_eos: bool = True
    temperature: float = Field(0.0, ge=0.0)
    # FASER's `speculation` extension: a policy name ("faser", "off", ...) or a JSON object.
    speculation: str | None = None
    timeout_s: float = Field(600.0, gt=0.0)
    prompts_path: str | None = None
    records_path: str | None = None
    seed: int = 0

    # The shape. Users for closed-loop shapes; `duration_s` bounds every shape.
    shape: Literal["step", "spike", "diurnal", "trace"] = "step"
    duration_s: float = Field(60.0, gt=0.0)
    users: int = Field(8, ge=1)  # peak users
    base_users: int = Field(1, ge=0)  # users at rest (step start, spike base, diurnal trough)
    step_users: int = Field(1, ge=1)
    step_s: float = Field(10.0, gt=0.0)
    spike_at_s: float | None = Field(None, ge=0.0)  # default: a third into the run
    spike_len_s: float | None = Field(None, gt=0.0)  # default: a sixth of the run
    period_s: float | None = Field(None, gt=0.0)  # diurnal period; default: the run's duration
    think_s: float = Field(0.0, ge=0.0)  # pause between one closed-loop user's requests

    # Trace replay (open loop).
    trace: str = "conv"  # "conv", "code" or a CSV path
    time_scale: float = Field(1.0, gt=0.0)  # replay offset = trace offset / time_scale
    trace_start_s: float = Field(0.0, ge=0.0)  # window start, trace seconds after its first row
    trace_span_s: float | None = Field(None, gt=0.0)  # window length in trace seconds
    max_requests: int | None = Field(None, ge=1)
    max_prompt_tokens: int = Field(512, ge=1)
    max_output_tokens: int = Field(128, ge=1)
    pool_users: int = Field(64, ge=1)  # most requests in flight at once during replay

    @model_validator(mode="after")
    def _check_users(self) -> LoadSettings:
        if self.base_users > self.users:
            raise ValueError(f"base_users ({self.base_users}) must not exceed users ({self.users})")
        speculation_field(self.speculation)  # fail at start, not on every request
        return self

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> LoadSettings:
        try:
            return cls.model_validate(dict(values))
        except ValidationError as error:
            names = ", ".join(".".join(map(str, e["loc"])) or "settings" for e in error.errors())
            raise ValueError(f"invalid load-test settings ({names}): {error}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LoadSettings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = json.loads(environ.get(SETTINGS_ENV) or "{}")
        for var, name in _ENV_FIELDS.items():
            if environ.get(var):
                values.setdefault(name, environ[var])
        return cls.from_mapping(values)


def speculation_field(value: str | None) -> dict[str, Any] | None:
    """The request's `speculation` body field from a policy name or a JSON object."""
    if not value:
        return None
    text = value.strip()
    if text[0] not in "{[":
        return {"policy": text}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"speculation must be a policy name or a JSON object, got {value!r}")
    return parsed
