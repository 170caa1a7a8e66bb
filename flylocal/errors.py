"""The one exception type the command line turns into a one-line error."""


class FlylocalError(Exception):
    """A problem with the user's input or setup, reported as one line without a traceback."""


class ModelError(FlylocalError):
    """A model file that cannot be used."""
