"""Every error kvforge raises on purpose derives from KvforgeError.

Messages are written for the person who reads them: what was wrong, the valid
choices, and what to do next.
"""


class KvforgeError(Exception):
    """Base of all deliberate kvforge errors."""


class ConfigError(KvforgeError, ValueError):
    """A configuration value is invalid; the message names the field and the choices."""


class PluginError(KvforgeError):
    """A plugin could not be loaded or registered."""


class ApiVersionError(PluginError):
    """A plugin targets an API version this host cannot serve."""


class DuplicateImplementationError(PluginError):
    """Two distributions registered the same (kind, name)."""


class SelectionError(KvforgeError, LookupError):
    """No implementation of a kind can serve the requested configuration."""


class UnsupportedConfigurationError(KvforgeError, ValueError):
    """An implementation was asked to serve a configuration it declares unsupported."""


class OutOfBlocksError(KvforgeError, RuntimeError):
    """The block pool cannot satisfy an allocation; nothing was changed."""


class BlockStateError(KvforgeError, ValueError):
    """A block operation does not match the block's state (double free, not held, out of range)."""


class RequestError(KvforgeError, ValueError):
    """A request is invalid; only that request is affected."""


class StructuredOutputError(KvforgeError, ValueError):
    """A structured-output spec is invalid or cannot be compiled; only its request is affected."""


class QuantizationError(KvforgeError, ValueError):
    """A quantizer was given input it cannot represent (NaN or infinity)."""


class DistributedError(KvforgeError, RuntimeError):
    """A rank of a tensor-parallel engine died, or a collective timed out; the message
    names the rank. The engine cannot go on: build a new one."""
