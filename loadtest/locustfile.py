"""Locust entry point: `locust -f loadtest/locustfile.py --host http://127.0.0.1:8000`.

Settings come from $FASER_LOADTEST (JSON of `loadtest.settings.LoadSettings`, written by
`python -m loadtest.run`) and a few single variables ($FASER_SHAPE, $FASER_PROMPTS,
$FASER_SPECULATION, $FASER_MODEL, $FASER_RECORDS). Only the chosen shape and its user class are
module attributes, because Locust runs every concrete class it finds here.
"""

from __future__ import annotations

from locust import events

from loadtest import locust_shapes, users
from loadtest.run_state import build_run_state
from loadtest.settings import LoadSettings

STATE = build_run_state(LoadSettings.from_env())

if STATE.settings.shape == "trace":
    class TraceUser(users.TraceReplayUser):
        state = STATE

    class TraceShape(locust_shapes.ReplayShape):
        state = STATE
else:
    class ChatUser(users.ClosedLoopUser):
        state = STATE

    class UsersShape(locust_shapes.ProfileShape):
        state = STATE


@events.quitting.add_listener
def _close_records(**_kwargs) -> None:
    STATE.writer.close()
