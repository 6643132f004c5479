"""The error an unreadable checkpoint or an unusable output directory gives `rlframe export`."""


class ExportError(ValueError):
    """A checkpoint or an output directory that cannot be exported to (the message says why and what to do)."""
