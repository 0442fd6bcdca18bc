"""The one exception type Mira raises for problems a user can fix; its message names the fix."""


class MiraError(Exception):
    """A user-facing error: bad input, a corrupt or mismatched store, a budget that cannot work."""
