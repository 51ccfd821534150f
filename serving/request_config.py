"""The pydantic settings every request body shares: an unknown field is refused
(400 naming it), and types are strict (`true` is not a token id). A module of its
own so that protocol.py and the models it imports (tool_calls.py) use one setting."""

from pydantic import ConfigDict

REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)
