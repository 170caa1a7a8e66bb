"""The one exception type the command line turns into a one-line error."""


class FlylocalError(Exception):
    """A problem with the user's input or setup, reported as one line without a traceback."""


class OptionError(FlylocalError):
    """Settings no engine can run, naming the one `option` (a Settings field) at fault; `api`
    says it in a request's terms (field names, the server's own flags), where it differs."""

    def __init__(self, message: str, option: str, api: str | None = None):
        super().__init__(message)
        self.option = option
        self.api = api or message


class ModelError(FlylocalError):
    """A model file that cannot be used."""


class GrammarError(FlylocalError):
    """A grammar or schema that cannot be used: the request's fault, not the server's."""
