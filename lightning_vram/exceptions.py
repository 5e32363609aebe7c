"""The warning category of the monitor, so users can filter it."""


class VramMonitorWarning(UserWarning):
    """Something could not be measured; training goes on and the report says what is missing."""
