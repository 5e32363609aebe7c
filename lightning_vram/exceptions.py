"""The warning category of the monitor, so users can filter it, and the names its warnings begin with."""

MONITOR = "VramMonitor"
"""The name a run's warnings begin with when the Lightning callback measures it: the object its user made."""
SESSION = "VramSession"
"""The name a run's warnings begin with when a :class:`~lightning_vram.VramSession` the user made measures it."""


class VramMonitorWarning(UserWarning):
    """Something could not be measured; training goes on and the report says what is missing."""
